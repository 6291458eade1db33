//! A Feast repository read as Quiver's feature groups: `feature_store.yaml`
//! (the project, the registry file, the Redis online store, the entity key
//! serialization version) and the registry (`registry.db`, a serialized
//! `feast.core.Registry`), and the plan that makes each served feature view
//! one group: keyed by its entity's join key, its features as columns in
//! the order the feature service lists them.
//!
//! A view of several entities is keyed by all their join keys (a composite
//! key), served as a string-keyed group whose key is the values' canonical
//! text (`redis_layout::composite_text`).
//!
//! What cannot be served exactly is refused with its name and the reason
//! (a view with no join key, a join key of another type, a
//! list, bytes or string feature, a view name that is no group name), so
//! `quiver feast inspect` can say it and serving never guesses.

use std::path::{Path, PathBuf};

use protobuf::{Message, MessageFull};
use serde::Deserialize;

use super::protos::Registry::Registry;
use super::protos::Value::value_type::Enum as ValueType;
use super::redis_layout::{JoinKeyType, KeyVersion};
use super::FeastError;
use crate::features::groups::check_name;
use crate::features::replica::KEY_BYTES_MAX;

/// The largest `feature_store.yaml` read: a real one is a few hundred bytes.
pub const STORE_YAML_BYTES_MAX: u64 = 1 << 20;

/// The largest registry file read. Feast's file registry holds every
/// object's definition, a few KB each; 256 MiB is far past any repository
/// served from one Redis.
pub const REGISTRY_BYTES_MAX: u64 = 256 << 20;

/// The most entities (join keys) one served view may have: a composite
/// key's canonical text is at most 64 bytes, so more parts than this could
/// hardly fit.
pub const JOIN_KEYS_MAX: usize = 8;

/// The most features one served view may have: the replica format's row width.
pub const VIEW_FEATURES_MAX: usize = crate::features::replica::DIM_MAX as usize;

/// `feature_store.yaml`, the parts Quiver reads; other keys are Feast's.
#[derive(Debug, Deserialize)]
struct StoreYaml {
    project: String,
    registry: RegistryYaml,
    #[serde(default)]
    online_store: Option<OnlineStoreYaml>,
    #[serde(default)]
    entity_key_serialization_version: Option<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum RegistryYaml {
    Path(String),
    Config {
        path: String,
        #[serde(default)]
        registry_type: Option<String>,
    },
}

#[derive(Debug, Deserialize)]
struct OnlineStoreYaml {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(default)]
    connection_string: Option<String>,
    #[serde(default)]
    redis_type: Option<String>,
}

/// Feast's Redis online store as `feature_store.yaml` names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OnlineStore {
    /// `host:port[,db=N][,password=...][,ssl=true]...`, Feast's form.
    pub connection_string: String,
    /// `redis` or `redis_cluster`.
    pub redis_type: String,
}

/// A feature's Feast value type, as far as Quiver serves it: each becomes
/// one f32 column.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FeatureType {
    Float,
    Double,
    Int32,
    Int64,
    Bool,
}

impl FeatureType {
    fn of(t: ValueType) -> Option<FeatureType> {
        Some(match t {
            ValueType::FLOAT => FeatureType::Float,
            ValueType::DOUBLE => FeatureType::Double,
            ValueType::INT32 => FeatureType::Int32,
            ValueType::INT64 => FeatureType::Int64,
            ValueType::BOOL => FeatureType::Bool,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            FeatureType::Float => "Float32",
            FeatureType::Double => "Float64",
            FeatureType::Int32 => "Int32",
            FeatureType::Int64 => "Int64",
            FeatureType::Bool => "Bool",
        }
    }
}

/// One column of a served view.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServedFeature {
    pub name: String,
    pub kind: FeatureType,
}

/// A feature view served as a feature group of the same name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServedView {
    pub name: String,
    /// The entity's name and its join key; for a view of several entities
    /// (a composite key), their names and join keys, comma-separated, the
    /// join keys in Feast's order (ascending).
    pub entity: String,
    pub join_key: String,
    /// The group key: the join key's type, or for a composite key a string
    /// (the values' canonical text, `redis_layout::composite_text`).
    pub key: JoinKeyType,
    /// Each join key and its type, in Feast's order.
    pub join_keys: Vec<(String, JoinKeyType)>,
    /// In the order the feature service (or the view) lists them.
    pub features: Vec<ServedFeature>,
    /// The view's ttl in seconds; 0: none.
    pub ttl_s: u64,
    /// The feature services that name it (empty when named as a view).
    pub services: Vec<String>,
}

/// Something a repository has that Quiver does not serve, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// `view` or `view:feature`.
    pub what: String,
    pub why: String,
}

/// A repository, read.
#[derive(Debug)]
pub struct FeastRepo {
    pub dir: PathBuf,
    pub project: String,
    pub registry_path: PathBuf,
    pub online_store: Option<OnlineStore>,
    pub key_version: KeyVersion,
    registry: Registry,
}

/// What serving `names` (feature services or views) from a repository
/// comes to: the views that become groups, and what is refused.
#[derive(Debug, Default)]
pub struct Plan {
    pub views: Vec<ServedView>,
    pub refused: Vec<Refusal>,
}

fn read_bounded(path: &Path, bytes_max: u64) -> Result<Vec<u8>, FeastError> {
    use std::io::Read;
    let io = |source| FeastError::Io { path: path.display().to_string(), source };
    let file = std::fs::File::open(path).map_err(io)?;
    let mut bytes = Vec::new();
    file.take(bytes_max + 1).read_to_end(&mut bytes).map_err(io)?;
    if bytes.len() as u64 > bytes_max {
        return Err(FeastError::Repo(format!("{} is larger than {bytes_max} bytes", path.display())));
    }
    Ok(bytes)
}

/// A registry file's bytes, walked for groups before they decode
/// ([`super::group_guard`]).
fn parse_registry(bytes: &[u8]) -> Result<Registry, String> {
    super::group_guard::check(bytes, &Registry::descriptor())?;
    Registry::parse_from_bytes(bytes).map_err(|e| e.to_string())
}

impl FeastRepo {
    /// Reads `dir/feature_store.yaml` and the file registry it names.
    pub fn open(dir: &Path) -> Result<FeastRepo, FeastError> {
        let yaml_path = dir.join("feature_store.yaml");
        let text = read_bounded(&yaml_path, STORE_YAML_BYTES_MAX)?;
        let yaml: StoreYaml =
            serde_norway::from_slice(&text).map_err(|e| FeastError::Repo(format!("{}: {e}", yaml_path.display())))?;
        let bad = |what: String| FeastError::Repo(format!("{}: {what}", yaml_path.display()));
        let registry_file = match &yaml.registry {
            RegistryYaml::Path(p) => p.clone(),
            RegistryYaml::Config { path, registry_type } => match registry_type.as_deref() {
                None | Some("file") => path.clone(),
                Some(other) => return Err(bad(format!("registry_type '{other}': only Feast's file registry is read"))),
            },
        };
        if registry_file.contains("://") {
            return Err(bad(format!("registry '{registry_file}': only a local registry file is read")));
        }
        let registry_path = dir.join(&registry_file);
        let key_version = match yaml.entity_key_serialization_version {
            None | Some(3) => KeyVersion::V3,
            Some(2) => KeyVersion::V2,
            Some(v) => return Err(bad(format!("entity_key_serialization_version {v}: Quiver reads 2 and 3"))),
        };
        let online_store = match yaml.online_store {
            None => None,
            Some(OnlineStoreYaml { kind, connection_string, redis_type }) => {
                match kind.as_deref() {
                    Some("redis") => {}
                    other => {
                        return Err(bad(format!(
                            "online_store type {}: Quiver reads Feast's Redis online store",
                            other.unwrap_or("(none)")
                        )))
                    }
                }
                Some(OnlineStore {
                    connection_string: connection_string.unwrap_or_else(|| "localhost:6379".into()),
                    redis_type: redis_type.unwrap_or_else(|| "redis".into()),
                })
            }
        };
        let bytes = read_bounded(&registry_path, REGISTRY_BYTES_MAX)?;
        let registry = parse_registry(&bytes)
            .map_err(|e| FeastError::Repo(format!("{}: not a Feast registry: {e}", registry_path.display())))?;
        Ok(FeastRepo {
            dir: dir.to_path_buf(),
            project: yaml.project,
            registry_path,
            online_store,
            key_version,
            registry,
        })
    }

    /// A repository of `project` whose registry file holds `bytes`, with
    /// no directory or online store: what `open` reads, without the files
    /// (tests/fuzz.rs feeds it mutated registries).
    pub fn from_registry(project: &str, key_version: KeyVersion, bytes: &[u8]) -> Result<FeastRepo, FeastError> {
        let registry = parse_registry(bytes).map_err(|e| FeastError::Repo(format!("not a Feast registry: {e}")))?;
        Ok(FeastRepo {
            dir: PathBuf::new(),
            project: project.into(),
            registry_path: PathBuf::new(),
            online_store: None,
            key_version,
            registry,
        })
    }

    /// The project's feature services and feature views, by name.
    pub fn service_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .registry
            .feature_services
            .iter()
            .filter(|s| s.spec.project == self.project)
            .map(|s| s.spec.name.clone())
            .collect();
        names.sort();
        names
    }

    pub fn view_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .registry
            .feature_views
            .iter()
            .filter(|v| v.spec.project == self.project)
            .map(|v| v.spec.name.clone())
            .collect();
        names.sort();
        names
    }

    /// The plan for serving `names`, each a feature service or a feature
    /// view of the project (a name that is both is the service); none: every
    /// feature service. A name that is neither is an error; so is a view
    /// named twice with different features.
    pub fn plan(&self, names: &[String]) -> Result<Plan, FeastError> {
        let names: Vec<String> = if names.is_empty() { self.service_names() } else { names.to_vec() };
        let mut plan = Plan::default();
        for name in &names {
            let service =
                self.registry.feature_services.iter().find(|s| s.spec.project == self.project && &s.spec.name == name);
            if let Some(service) = service {
                for projection in &service.spec.features {
                    let columns: Vec<String> = projection.feature_columns.iter().map(|f| f.name.clone()).collect();
                    self.add_view(&mut plan, &projection.feature_view_name, Some(&columns), Some(name))?;
                }
                continue;
            }
            if self.view(name).is_some() {
                self.add_view(&mut plan, name, None, None)?;
                continue;
            }
            let on_demand = self.registry.on_demand_feature_views.iter().any(|v| &v.spec.name == name);
            let stream = self.registry.stream_feature_views.iter().any(|v| &v.spec.name == name);
            let why = if on_demand {
                "is an on-demand feature view: Feast computes it at request time, Redis holds none of it"
            } else if stream {
                "is a stream feature view: Quiver serves batch feature views"
            } else {
                "is no feature service or feature view of the project"
            };
            return Err(FeastError::Repo(format!("'{name}' {why} (project '{}')", self.project)));
        }
        Ok(plan)
    }

    fn view(&self, name: &str) -> Option<&super::protos::FeatureView::FeatureView> {
        self.registry.feature_views.iter().find(|v| v.spec.project == self.project && v.spec.name == name)
    }

    /// Adds view `name` with `columns` (none: all of its features, in its
    /// order) to the plan, or its refusal.
    fn add_view(
        &self,
        plan: &mut Plan,
        name: &str,
        columns: Option<&[String]>,
        service: Option<&String>,
    ) -> Result<(), FeastError> {
        let refuse = |plan: &mut Plan, what: String, why: String| plan.refused.push(Refusal { what, why });
        let Some(view) = self.view(name) else {
            let why = if self.registry.on_demand_feature_views.iter().any(|v| v.spec.name == name) {
                "an on-demand feature view: Feast computes it at request time, Redis holds none of it"
            } else {
                "no batch feature view of the project by this name"
            };
            refuse(plan, name.into(), why.into());
            return Ok(());
        };
        let spec = &view.spec;
        if let Err(why) = check_name(name) {
            refuse(plan, name.into(), format!("{why}: a served view's name is its group's name"));
            return Ok(());
        }
        if !spec.online {
            refuse(plan, name.into(), "online = False: Feast does not materialize it".into());
            return Ok(());
        }
        if spec.entities.is_empty() {
            refuse(plan, name.into(), "has no entity (Feast keys it by a dummy key): nothing to look it up by".into());
            return Ok(());
        }
        // Each entity's join key and type; several make a composite key.
        let mut join_keys: Vec<(String, JoinKeyType)> = Vec::with_capacity(spec.entities.len());
        for entity in &spec.entities {
            let Some(entity_def) =
                self.registry.entities.iter().find(|e| e.spec.project == self.project && &e.spec.name == entity)
            else {
                refuse(plan, name.into(), format!("its entity '{entity}' is not in the registry"));
                return Ok(());
            };
            let join_key = entity_def.spec.join_key.clone();
            // The entity column's type, as the view records it; the entity's
            // own as a fallback for registries written before views recorded it.
            let key_type = spec
                .entity_columns
                .iter()
                .find(|c| c.name == join_key)
                .map(|c| c.value_type.enum_value_or_default())
                .unwrap_or(entity_def.spec.value_type.enum_value_or_default());
            let key = match key_type {
                ValueType::INT64 => JoinKeyType::Int64,
                ValueType::INT32 => JoinKeyType::Int32,
                ValueType::STRING => JoinKeyType::String { bytes_max: KEY_BYTES_MAX },
                other => {
                    refuse(
                        plan,
                        name.into(),
                        format!("its join key '{join_key}' is {other:?}: Quiver keys groups by int64, int32 or string"),
                    );
                    return Ok(());
                }
            };
            if join_keys.iter().any(|(k, _)| *k == join_key) {
                refuse(plan, name.into(), format!("two of its entities have the join key '{join_key}'"));
                return Ok(());
            }
            join_keys.push((join_key, key));
        }
        if join_keys.len() > JOIN_KEYS_MAX {
            refuse(
                plan,
                name.into(),
                format!("has {} entities: a composite key has at most {JOIN_KEYS_MAX}", join_keys.len()),
            );
            return Ok(());
        }
        // Feast's order: by join key name.
        join_keys.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
        let key = match join_keys.as_slice() {
            [(_, one)] => *one,
            _ => JoinKeyType::String { bytes_max: KEY_BYTES_MAX },
        };
        let wanted: Vec<&str> = match columns {
            Some(c) if !c.is_empty() => c.iter().map(String::as_str).collect(),
            _ => spec.features.iter().map(|f| f.name.as_str()).collect(),
        };
        let mut features = Vec::with_capacity(wanted.len());
        let mut refused_features = false;
        for feature in wanted {
            let Some(f) = spec.features.iter().find(|f| f.name == feature) else {
                refuse(plan, format!("{name}:{feature}"), "the view has no such feature".into());
                refused_features = true;
                continue;
            };
            let t = f.value_type.enum_value_or_default();
            match FeatureType::of(t) {
                Some(kind) => features.push(ServedFeature { name: f.name.clone(), kind }),
                None => {
                    refuse(
                        plan,
                        format!("{name}:{feature}"),
                        format!("{t:?} features are not served (float, double, int32, int64 and bool are)"),
                    );
                    refused_features = true;
                }
            }
        }
        if refused_features {
            refuse(plan, name.into(), "a feature it serves is refused (above)".into());
            return Ok(());
        }
        if features.is_empty() || features.len() > VIEW_FEATURES_MAX {
            refuse(plan, name.into(), format!("{} features; a group has 1 to {VIEW_FEATURES_MAX}", features.len()));
            return Ok(());
        }
        let ttl_s = spec.ttl.as_ref().map_or(0, |d| u64::try_from(d.seconds).unwrap_or(0));
        if let Some(same) = plan.views.iter_mut().find(|v| v.name == name) {
            if same.features != features {
                return Err(FeastError::Repo(format!(
                    "feature view '{name}' is served twice with different features ({}): a view is one group",
                    same.services.iter().chain(service).cloned().collect::<Vec<_>>().join(", ")
                )));
            }
            same.services.extend(service.cloned());
            return Ok(());
        }
        plan.views.push(ServedView {
            name: name.into(),
            entity: spec.entities.join(", "),
            join_key: join_keys.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>().join(","),
            key,
            join_keys,
            features,
            ttl_s,
            services: service.cloned().into_iter().collect(),
        });
        Ok(())
    }
}

/// Feast's connection string as Quiver's URL form: for `redis_type:
/// redis`, `host:port[,db=N][,username=U][,password=P][,ssl=true]` becomes
/// `redis://...`; for `redis_type: redis_cluster`, the nodes
/// `host:port,host:port,...` (any of the cluster's, as Feast takes them)
/// with the same options but `db` become `redis+cluster://...`. Options
/// Quiver has no use for are refused by name, so that none is silently
/// dropped; so is `redis_sentinel`.
pub fn redis_url(store: &OnlineStore) -> Result<String, FeastError> {
    let cluster = match store.redis_type.as_str() {
        "redis" => false,
        "redis_cluster" => true,
        other => {
            return Err(FeastError::Repo(format!(
                "online_store redis_type '{other}': Quiver reads redis and redis_cluster online stores"
            )))
        }
    };
    let (mut addrs, mut options) = (Vec::new(), Vec::new());
    for part in store.connection_string.split(',').map(str::trim) {
        match part.split_once('=') {
            Some(kv) => options.push(kv),
            None if !part.is_empty() => addrs.push(part),
            None => {}
        }
    }
    if addrs.is_empty() {
        return Err(FeastError::Repo("online_store connection_string names no host:port".into()));
    }
    if !cluster && addrs.len() > 1 {
        return Err(FeastError::Repo(format!(
            "online_store connection_string names {} nodes, but redis_type is redis (one node): Feast would use \
             the first only; name one, or set redis_type: redis_cluster",
            addrs.len()
        )));
    }
    let (mut db, mut user, mut password, mut tls) = (None, None, None, false);
    for (k, v) in options {
        match k.trim() {
            "db" => db = Some(v.trim().to_string()),
            "username" => user = Some(v.trim().to_string()),
            "password" => password = Some(v.trim().to_string()),
            "ssl" => tls = v.trim().eq_ignore_ascii_case("true"),
            other => {
                return Err(FeastError::Repo(format!(
                    "online_store connection_string option '{other}' is not read by Quiver (db, username, password, ssl are)"
                )))
            }
        }
    }
    let encode = |s: &str| -> String {
        s.bytes()
            .map(|b| {
                if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                    char::from(b).to_string()
                } else {
                    format!("%{b:02X}")
                }
            })
            .collect()
    };
    let auth = match (user, password) {
        (None, None) => String::new(),
        (u, Some(p)) => format!("{}:{}@", encode(u.as_deref().unwrap_or("")), encode(&p)),
        (Some(_), None) => {
            return Err(FeastError::Repo("online_store connection_string has a username but no password".into()))
        }
    };
    let scheme = match (tls, cluster) {
        (false, false) => "redis",
        (true, false) => "rediss",
        (false, true) => "redis+cluster",
        (true, true) => "rediss+cluster",
    };
    if cluster && db.as_deref().is_some_and(|d| d != "0") {
        return Err(FeastError::Repo(
            "online_store connection_string: db on a Redis Cluster (only db 0 exists)".into(),
        ));
    }
    let db = if cluster { None } else { db };
    Ok(format!("{scheme}://{auth}{}{}", addrs.join(","), db.map_or(String::new(), |d| format!("/{d}"))))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(s: &str) -> OnlineStore {
        OnlineStore { connection_string: s.into(), redis_type: "redis".into() }
    }

    #[test]
    fn connection_strings_become_urls() {
        assert_eq!(redis_url(&store("localhost:6379")).unwrap(), "redis://localhost:6379");
        assert_eq!(redis_url(&store("r:7000,db=3")).unwrap(), "redis://r:7000/3");
        assert_eq!(redis_url(&store("r:1,password=a@b,ssl=true")).unwrap(), "rediss://:a%40b@r:1");
        assert_eq!(redis_url(&store("r:1,username=u,password=p")).unwrap(), "redis://u:p@r:1");
        assert!(redis_url(&store("r:1,socket_timeout=3")).unwrap_err().to_string().contains("socket_timeout"));
        assert!(redis_url(&store("")).is_err());
        let cluster = |s: &str| OnlineStore { redis_type: "redis_cluster".into(), ..store(s) };
        assert_eq!(redis_url(&cluster("a:1,b:2,password=p")).unwrap(), "redis+cluster://:p@a:1,b:2");
        assert_eq!(redis_url(&cluster("a:1,ssl=true,db=0")).unwrap(), "rediss+cluster://a:1");
        assert!(redis_url(&cluster("a:1,db=2")).unwrap_err().to_string().contains("only db 0"));
        assert!(redis_url(&store("a:1,b:2")).unwrap_err().to_string().contains("redis_cluster"));
        let sentinel = OnlineStore { redis_type: "redis_sentinel".into(), ..store("r:1") };
        assert!(redis_url(&sentinel).unwrap_err().to_string().contains("redis_sentinel"));
    }

    #[test]
    fn store_yaml_reads_both_registry_forms_and_refuses_what_it_cannot_serve() {
        let dir = std::env::temp_dir().join(format!("quiver-feast-yaml-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let open = |yaml: &str| {
            std::fs::write(dir.join("feature_store.yaml"), yaml).unwrap();
            FeastRepo::open(&dir)
        };
        // An empty registry file is an empty (valid) registry.
        std::fs::write(dir.join("reg.db"), b"").unwrap();
        let repo = open("project: p\nregistry: reg.db\nonline_store:\n  type: redis\n").unwrap();
        assert_eq!((repo.project.as_str(), repo.key_version), ("p", KeyVersion::V3));
        assert_eq!(repo.online_store.unwrap().connection_string, "localhost:6379");
        let repo = open(
            "project: p\nregistry:\n  path: reg.db\n  cache_ttl_seconds: 5\nentity_key_serialization_version: 2\n",
        )
        .unwrap();
        assert_eq!(repo.key_version, KeyVersion::V2);
        let err = |yaml: &str, want: &str| {
            let e = open(yaml).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        };
        err("project: p\nregistry: s3://b/r.db\n", "local registry file");
        err("project: p\nregistry:\n  path: x\n  registry_type: sql\n", "registry_type 'sql'");
        err("project: p\nregistry: reg.db\nonline_store:\n  type: sqlite\n", "online_store type sqlite");
        err("project: p\nregistry: reg.db\nentity_key_serialization_version: 1\n", "reads 2 and 3");
        err("project: p\nregistry: missing.db\n", "missing.db");
        std::fs::write(dir.join("bad.db"), b"\xff\xff\xff").unwrap();
        err("project: p\nregistry: bad.db\n", "not a Feast registry");
        err("registry: [\n", "feature_store.yaml");
        let e = open("project: p\nregistry: reg.db\n").unwrap().plan(&["nope".into()]).unwrap_err().to_string();
        assert!(e.contains("'nope' is no feature service or feature view"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
