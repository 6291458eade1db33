//! Feature groups as configuration: the entities a request may name
//! (`[[groups]]`), each with its scope, key type, width, storage and the
//! policy for a request that does not carry its key.
//!
//! A group is one replica file (one per bucket when bucketed) and one
//! segment of a model's input row. Without `[[groups]]` the server has the
//! two groups it always had: `user` (request scope) and `item` (candidate
//! scope), keyed by u64 and taken from a request's `user_id` and `item_ids`.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::replica::{KeyKind, Storage, DIM_MAX, GROUP_NAME_BYTES_MAX, KEY_BYTES_MAX};

/// Most feature groups one server serves: each is a replica view per
/// shard, a lookup loop per request and a slot in fixed per-request arrays.
pub const GROUPS_MAX: usize = 16;

/// How many keys of a group one request carries.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// One key per request (user, card, device, publisher): its row is read
    /// once and broadcast to every candidate.
    #[default]
    Request,
    /// One key per candidate (item, ad, campaign).
    Candidate,
}

impl Scope {
    pub fn name(self) -> &'static str {
        match self {
            Scope::Request => "request",
            Scope::Candidate => "candidate",
        }
    }
}

/// The type of a group's keys.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum KeyType {
    #[default]
    U64,
    /// Byte strings up to the group's `key_bytes_max`, filed under their
    /// 64-bit hash with the whole key compared on every lookup.
    String,
}

impl KeyType {
    pub fn name(self) -> &'static str {
        match self {
            KeyType::U64 => "u64",
            KeyType::String => "string",
        }
    }
}

/// What a request that does not carry a group's key gets.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Absent {
    /// `BadRequest`, naming the group (the default for every group but
    /// `user` and `item`, whose keys default to `user_id` 0 and `item_ids`).
    #[default]
    Reject,
    /// The group's default row, counted in `features_missing`.
    Default,
}

/// One `[[groups]]` entry.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct GroupConfig {
    /// The group's name: its Redis keys, its replica file, the name a
    /// request and a model's `--inputs` use. At most 16 bytes of
    /// `[A-Za-z0-9_-]`.
    pub name: String,
    #[serde(default)]
    pub scope: Scope,
    #[serde(default)]
    pub key: KeyType,
    /// Longest string key, in bytes (1 to 64); string keys only.
    #[serde(default = "key_bytes_max_default")]
    pub key_bytes_max: u32,
    /// Floats per row: the width a new replica is created with and an
    /// existing one must have; default: what the served model reads.
    #[serde(default)]
    pub width: Option<u32>,
    /// How a new replica stores its rows; default f32 (for `user` and
    /// `item`, `feed.user_storage` and `feed.item_storage`).
    #[serde(default)]
    pub storage: Option<Storage>,
    /// The row a missing key reads, for a replica this server creates;
    /// default zeros. An existing file keeps its own.
    #[serde(default)]
    pub default: Vec<f32>,
    /// The replica file; default `<data_dir>/<name>.qrep` (for `user` and
    /// `item`, `user_features` and `item_features` when set).
    #[serde(default)]
    pub path: Option<PathBuf>,
    /// What a request without this group's key gets; default `reject`
    /// (`default` for `user` and `item`).
    #[serde(default)]
    pub absent: Option<Absent>,
    /// The group each row names a key of (`ad`'s rows name a `campaign`):
    /// the parent's rows are looked up through those links, so a request
    /// never carries the parent's keys. Same scope as this group; a chain
    /// follows at most 4 links; a group is the parent of one group at most.
    #[serde(default)]
    pub parent: Option<String>,
}

fn key_bytes_max_default() -> u32 {
    KEY_BYTES_MAX
}

/// A group resolved against the rest of the configuration: what the
/// feed, the server and the request path are built from.
#[derive(Clone, Debug, PartialEq)]
pub struct Group {
    pub name: String,
    pub scope: Scope,
    pub key: KeyKind,
    pub width: Option<u32>,
    pub storage: Storage,
    pub default: Vec<f32>,
    pub path: PathBuf,
    pub absent: Absent,
    /// The group this one's rows link to, and its key kind (what each
    /// row's link holds).
    pub parent: Option<(String, KeyKind)>,
    /// The group whose rows link to this one: its keys come from there.
    pub child: Option<String>,
}

/// Most links one chain of parents follows (`ad` → `campaign` →
/// `advertiser` is two): each is a dependent memory load per candidate, so
/// the chain, not the group count, sets the latency floor of a request's
/// lookups.
pub const CHAIN_LINKS_MAX: usize = 4;

/// The groups a configuration without `[[groups]]` serves.
pub fn legacy(user: (PathBuf, Option<u32>, Storage), item: (PathBuf, Option<u32>, Storage)) -> Vec<Group> {
    let group = |name: &str, scope, (path, width, storage): (PathBuf, Option<u32>, Storage)| Group {
        name: name.into(),
        scope,
        key: KeyKind::U64,
        width,
        storage,
        default: Vec::new(),
        path,
        absent: Absent::Default,
        parent: None,
        child: None,
    };
    vec![group("user", Scope::Request, user), group("item", Scope::Candidate, item)]
}

/// Checks `name` as a group name: not empty, at most
/// [`GROUP_NAME_BYTES_MAX`] bytes of `[A-Za-z0-9_-]` (it is part of every
/// Redis key and file name of the group), and not a reserved input name.
pub fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > GROUP_NAME_BYTES_MAX {
        return Err(format!("group name '{name}' must be 1 to {GROUP_NAME_BYTES_MAX} bytes"));
    }
    if !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') {
        return Err(format!("group name '{name}' may hold only letters, digits, '_' and '-'"));
    }
    if name == "context" || name == "context_ids" {
        return Err(format!("'{name}' is a request input, not a feature group"));
    }
    Ok(())
}

impl GroupConfig {
    /// Checks the entry and resolves its defaults: `data_dir` for the
    /// path, `legacy` for what `user` and `item` inherit from the older
    /// keys (their path, width and storage).
    pub fn resolve(&self, data_dir: &Path, legacy: &[Group]) -> Result<Group, String> {
        check_name(&self.name)?;
        let inherited = legacy.iter().find(|g| g.name == self.name);
        if !(1..=KEY_BYTES_MAX).contains(&self.key_bytes_max) {
            return Err(format!(
                "groups.{}.key_bytes_max = {} is outside 1..={KEY_BYTES_MAX}",
                self.name, self.key_bytes_max
            ));
        }
        let key = match self.key {
            KeyType::U64 => KeyKind::U64,
            KeyType::String => KeyKind::Str { bytes_max: self.key_bytes_max },
        };
        if let Some(w) = self.width {
            if !(1..=DIM_MAX).contains(&w) {
                return Err(format!("groups.{}.width = {w} is outside 1..={DIM_MAX}", self.name));
            }
        }
        let width = self.width.or(inherited.and_then(|g| g.width));
        if !self.default.is_empty() {
            match width {
                Some(w) if w as usize == self.default.len() => {}
                Some(w) => {
                    return Err(format!(
                        "groups.{}.default has {} floats, the group's width is {w}",
                        self.name,
                        self.default.len()
                    ))
                }
                None => return Err(format!("groups.{}.default needs groups.{}.width", self.name, self.name)),
            }
            if let Some(bad) = self.default.iter().find(|v| !v.is_finite()) {
                return Err(format!("groups.{}.default holds {bad}: rows must be finite", self.name));
            }
        }
        Ok(Group {
            name: self.name.clone(),
            scope: self.scope,
            key,
            width,
            storage: self.storage.or(inherited.map(|g| g.storage)).unwrap_or(Storage::F32),
            default: self.default.clone(),
            path: match (&self.path, inherited) {
                (Some(p), _) => p.clone(),
                (None, Some(g)) => g.path.clone(),
                (None, None) => data_dir.join(format!("{}.qrep", self.name)),
            },
            absent: self.absent.unwrap_or(if inherited.is_some() { Absent::Default } else { Absent::Reject }),
            // Resolved against the other groups by `resolve_all`.
            parent: None,
            child: None,
        })
    }
}

/// Resolves every entry of `[[groups]]` (or the legacy pair when there is
/// none) and checks the set: at most [`GROUPS_MAX`], names unique, `user`
/// at request scope and `item` at candidate scope (a request's `user_id`
/// and `item_ids` key them).
pub fn resolve_all(configs: &[GroupConfig], data_dir: &Path, legacy: Vec<Group>) -> Result<Vec<Group>, String> {
    if configs.is_empty() {
        return Ok(legacy);
    }
    if configs.len() > GROUPS_MAX {
        return Err(format!("{} [[groups]] configured, at most {GROUPS_MAX}", configs.len()));
    }
    let mut groups: Vec<Group> = Vec::with_capacity(configs.len());
    for c in configs {
        let g = c.resolve(data_dir, &legacy)?;
        if groups.iter().any(|o| o.name == g.name) {
            return Err(format!("group '{}' is configured twice", g.name));
        }
        if let Some(o) = groups.iter().find(|o| o.path == g.path) {
            return Err(format!("groups '{}' and '{}' name one file, {}", o.name, g.name, g.path.display()));
        }
        match (g.name.as_str(), g.scope) {
            ("user", Scope::Candidate) => return Err("group 'user' must have scope = \"request\"".into()),
            ("item", Scope::Request) => return Err("group 'item' must have scope = \"candidate\"".into()),
            _ => {}
        }
        groups.push(g);
    }
    link_parents(configs, &mut groups)?;
    Ok(groups)
}

/// Resolves each `parent` against the groups and checks the links: the
/// parent exists, is not the group itself, has its scope, is no group a
/// request keys by `user_id` or `item_ids`, is the parent of no other
/// group, and no chain loops or follows more than [`CHAIN_LINKS_MAX`] links.
fn link_parents(configs: &[GroupConfig], groups: &mut [Group]) -> Result<(), String> {
    for (i, c) in configs.iter().enumerate() {
        let Some(parent) = &c.parent else { continue };
        let child = &groups[i].name;
        let Some(p) = groups.iter().position(|g| &g.name == parent) else {
            return Err(format!("groups.{child}.parent = '{parent}' is no configured group"));
        };
        if p == i {
            return Err(format!("groups.{child}.parent names the group itself"));
        }
        if groups[p].scope != groups[i].scope {
            return Err(format!(
                "groups.{child}.parent = '{parent}': a parent has its child's scope ('{parent}' is {}-scope, '{child}' {}-scope)",
                groups[p].scope.name(),
                groups[i].scope.name()
            ));
        }
        if parent == "user" || parent == "item" {
            return Err(format!("groups.{child}.parent = '{parent}': '{parent}' is keyed by the request itself"));
        }
        if let Some(other) = &groups[p].child {
            return Err(format!(
                "groups '{other}' and '{child}' both name '{parent}' as their parent; a group has one child"
            ));
        }
        let child = child.clone();
        groups[p].child = Some(child);
        groups[i].parent = Some((parent.clone(), groups[p].key));
    }
    for g in groups.iter() {
        let mut at = g;
        for links in 0.. {
            let Some((parent, _)) = &at.parent else { break };
            if links == CHAIN_LINKS_MAX {
                return Err(format!(
                    "the chain of parents from group '{}' loops or follows more than {CHAIN_LINKS_MAX} links",
                    g.name
                ));
            }
            at = groups.iter().find(|o| &o.name == parent).expect("parents resolved above");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn legacy_pair() -> Vec<Group> {
        legacy(
            (PathBuf::from("d/user.qrep"), Some(8), Storage::F16),
            (PathBuf::from("d/item.qrep"), None, Storage::F32),
        )
    }

    fn parse(toml_text: &str) -> Vec<GroupConfig> {
        #[derive(Deserialize)]
        struct Doc {
            groups: Vec<GroupConfig>,
        }
        toml::from_str::<Doc>(toml_text).expect("test toml parses").groups
    }

    #[test]
    fn no_groups_is_the_legacy_pair() {
        let groups = resolve_all(&[], Path::new("d"), legacy_pair()).unwrap();
        assert_eq!(groups.iter().map(|g| g.name.as_str()).collect::<Vec<_>>(), ["user", "item"]);
        assert_eq!(groups[1].scope, Scope::Candidate);
        assert!(groups.iter().all(|g| g.absent == Absent::Default && g.key == KeyKind::U64));
    }

    #[test]
    fn groups_resolve_with_their_defaults() {
        let configs = parse(
            r#"
            [[groups]]
            name = "user"
            [[groups]]
            name = "device"
            key = "string"
            key_bytes_max = 40
            width = 3
            default = [0.5, 0.5, 0.5]
            [[groups]]
            name = "ad"
            scope = "candidate"
            storage = "int8"
            absent = "default"
            "#,
        );
        let groups = resolve_all(&configs, Path::new("d"), legacy_pair()).unwrap();
        let (user, device, ad) = (&groups[0], &groups[1], &groups[2]);
        assert_eq!((user.path.as_path(), user.width, user.storage), (Path::new("d/user.qrep"), Some(8), Storage::F16));
        assert_eq!(user.absent, Absent::Default);
        assert_eq!(device.key, KeyKind::Str { bytes_max: 40 });
        assert_eq!((device.path.as_path(), device.absent), (Path::new("d/device.qrep"), Absent::Reject));
        assert_eq!((ad.scope, ad.storage, ad.absent), (Scope::Candidate, Storage::Int8, Absent::Default));
    }

    #[test]
    fn bad_groups_are_refused_by_name() {
        let bad = |text: &str, want: &str| {
            let e = resolve_all(&parse(text), Path::new("d"), legacy_pair()).unwrap_err();
            assert!(e.contains(want), "{e}");
        };
        bad("[[groups]]\nname = \"a b\"", "letters");
        bad("[[groups]]\nname = \"a_name_over_16_bytes\"", "1 to 16 bytes");
        bad("[[groups]]\nname = \"context\"", "request input");
        bad("[[groups]]\nname = \"x\"\n[[groups]]\nname = \"x\"", "twice");
        bad("[[groups]]\nname = \"user\"\nscope = \"candidate\"", "scope = \"request\"");
        bad("[[groups]]\nname = \"item\"", "scope = \"candidate\"");
        bad("[[groups]]\nname = \"k\"\nkey = \"string\"\nkey_bytes_max = 65", "outside 1..=64");
        bad("[[groups]]\nname = \"k\"\nwidth = 2\ndefault = [1.0]", "width is 2");
        bad("[[groups]]\nname = \"k\"\ndefault = [1.0]", "needs groups.k.width");
        bad("[[groups]]\nname = \"k\"\nwidth = 0", "outside 1..=4096");
        let many: String = (0..17).map(|i| format!("[[groups]]\nname = \"g{i}\"\n")).collect();
        bad(&many, "at most 16");
        let g = |name: &str, scope: &str, parent: &str| {
            format!("[[groups]]\nname = \"{name}\"\nscope = \"{scope}\"\nparent = \"{parent}\"\n")
        };
        let plain = |name: &str, scope: &str| format!("[[groups]]\nname = \"{name}\"\nscope = \"{scope}\"\n");
        bad(&g("ad", "candidate", "nowhere"), "no configured group");
        bad(&g("ad", "candidate", "ad"), "the group itself");
        bad(&(g("ad", "candidate", "publisher") + &plain("publisher", "request")), "a parent has its child's scope");
        bad(&(g("ad", "candidate", "item") + &plain("item", "candidate")), "keyed by the request itself");
        bad(
            &(g("ad", "candidate", "campaign")
                + &g("promo", "candidate", "campaign")
                + &plain("campaign", "candidate")),
            "a group has one child",
        );
        bad(&(g("a", "request", "b") + &g("b", "request", "a")), "loops or follows more than 4 links");
        let long: String = (0..6).map(|i| g(&format!("g{i}"), "request", &format!("g{}", i + 1))).collect();
        bad(&(long + &plain("g6", "request")), "loops or follows more than 4 links");
    }

    #[test]
    fn parents_resolve_to_their_key_kind_and_child() {
        let configs = parse(
            r#"
            [[groups]]
            name = "ad"
            scope = "candidate"
            parent = "campaign"
            [[groups]]
            name = "campaign"
            scope = "candidate"
            key = "string"
            key_bytes_max = 24
            parent = "advertiser"
            [[groups]]
            name = "advertiser"
            scope = "candidate"
            "#,
        );
        let groups = resolve_all(&configs, Path::new("d"), legacy_pair()).unwrap();
        assert_eq!(groups[0].parent, Some(("campaign".into(), KeyKind::Str { bytes_max: 24 })));
        assert_eq!(groups[1].parent, Some(("advertiser".into(), KeyKind::U64)));
        assert_eq!((groups[1].child.as_deref(), groups[2].child.as_deref()), (Some("ad"), Some("campaign")));
        assert_eq!((groups[0].child.as_deref(), groups[2].parent.as_ref()), (None, None));
    }
}
