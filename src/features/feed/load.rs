//! Bulk loading of a feature text file into Redis through the publish script.
//!
//! The input is the text format `quiver replica build` reads (`id,f0,f1,...` per line, `#`
//! comments, blank lines ignored), so one file can seed both a replica and Redis. A `default`
//! line has no meaning in Redis (the default vector belongs to the replica) and is skipped.
//! The whole file is checked before the first write, so a bad line leaves Redis untouched.
//! A string-keyed group's file has the key as written in the first field (what `quiver replica
//! build --key-bytes` reads), each key checked against the group's limit.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::time::Instant;

use super::contract::{check_group, check_str_key, EntityKeyBuf, KeyKind, LinkedRow, PUT_BATCH_ROWS};
use super::{FeedError, Publisher};
use crate::features::replica::{parse_keyed_line, KeyedLine};

/// One meaningful line of a feature file, of either key kind; a row names
/// its parent's key in a file of a group with a parent.
#[derive(Clone, Debug, PartialEq)]
enum Line {
    Row(EntityKeyBuf, Vec<f32>, Option<EntityKeyBuf>),
    Default(Vec<f32>),
}

/// Parses one line for a group keyed by `kind` whose parent is keyed by
/// `link`, as `replica build` does, and checks a string key against the
/// group's limit.
fn parse_line(text: &str, kind: KeyKind, link: Option<KeyKind>) -> Result<Option<Line>, String> {
    Ok(match parse_keyed_line(text, kind, link)? {
        None => None,
        Some(KeyedLine::Default(values)) => Some(Line::Default(values)),
        Some(KeyedLine::Row { key, parent, values }) => {
            if let (EntityKeyBuf::Str(bytes), KeyKind::Str { bytes_max }) = (&key, kind) {
                check_str_key(bytes, bytes_max)
                    .map_err(|e| format!("key '{}': {e}", String::from_utf8_lossy(bytes)))?;
            }
            Some(Line::Row(key, values, parent))
        }
    })
}

/// Rows handed to one [`Publisher::put_many`] call: several pipelined batches, so the parsed
/// rows held in memory stay bounded however long the file is.
const LOAD_CHUNK_ROWS: usize = 10 * PUT_BATCH_ROWS;

/// What a load wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadSummary {
    pub rows: usize,
    pub dim: usize,
    /// `default` lines skipped.
    pub defaults_skipped: usize,
    /// The sequence number of the last change written (0 when no rows).
    pub last_seq: u64,
    pub elapsed_s: f64,
}

/// What the checking pass learned about a file.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FileCheck {
    pub rows: usize,
    pub dim: usize,
    pub defaults: usize,
}

/// The ids listed in `path`, one per line; `#` comments and blank lines are
/// skipped, anything else that is not a u64 is an error naming the line.
pub fn read_ids(path: &Path) -> Result<Vec<u64>, FeedError> {
    let file = File::open(path).map_err(|source| FeedError::Io { path: path.display().to_string(), source })?;
    let mut ids = Vec::new();
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|source| FeedError::Io { path: path.display().to_string(), source })?;
        let text = line.split('#').next().unwrap_or("").trim();
        if text.is_empty() {
            continue;
        }
        let id = text.parse().map_err(|_| input_err(path, i + 1, format!("'{text}' is not an id (a u64)")))?;
        ids.push(id);
    }
    Ok(ids)
}

/// The string keys listed in `path`, one per line (the whole line, trimmed); `#` comments
/// and blank lines are skipped, a key outside 1 to `bytes_max` bytes is an error naming the line.
pub fn read_str_keys(path: &Path, bytes_max: u32) -> Result<Vec<Vec<u8>>, FeedError> {
    let file = File::open(path).map_err(|source| FeedError::Io { path: path.display().to_string(), source })?;
    let mut keys = Vec::new();
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|source| FeedError::Io { path: path.display().to_string(), source })?;
        let text = line.trim();
        if text.is_empty() || text.starts_with('#') {
            continue;
        }
        check_str_key(text.as_bytes(), bytes_max).map_err(|e| input_err(path, i + 1, format!("key '{text}': {e}")))?;
        keys.push(text.as_bytes().to_vec());
    }
    Ok(keys)
}

/// Checks the whole file (numbers, dimension, keys, duplicates) of a u64 group without
/// keeping its rows.
pub fn check_file(path: &Path) -> Result<FileCheck, FeedError> {
    check_file_keyed(path, KeyKind::U64, None)
}

/// [`check_file`] for a group keyed by `kind` whose parent (if it has one)
/// is keyed by `link`: each row line then names the parent's key after its
/// own (`-`: none).
pub fn check_file_keyed(path: &Path, kind: KeyKind, link: Option<KeyKind>) -> Result<FileCheck, FeedError> {
    let mut dim = None;
    let mut defaults = 0;
    // (key, line) pairs, sorted afterwards: duplicates become neighbours, at a few words a row
    // instead of a hash set's overhead.
    let mut keys: Vec<(EntityKeyBuf, usize)> = Vec::new();
    for_each_line(path, kind, link, &mut dim, |line_no, line| {
        match line {
            Line::Row(key, _, _) => keys.push((key, line_no)),
            Line::Default(_) => defaults += 1,
        }
        Ok(())
    })?;
    keys.sort_unstable();
    if let Some(w) = keys.windows(2).find(|w| w[0].0 == w[1].0) {
        let (first, second) = if w[0].1 < w[1].1 { (w[0].1, w[1].1) } else { (w[1].1, w[0].1) };
        let what = match &w[0].0 {
            EntityKeyBuf::Id(id) => format!("duplicate id {id}"),
            key => format!("duplicate key {}", key.as_key()),
        };
        return Err(input_err(path, second, format!("{what} (first on line {first})")));
    }
    match dim {
        Some(dim) => Ok(FileCheck { rows: keys.len(), dim, defaults }),
        None => Err(input_err(path, 0, "no rows".into())),
    }
}

/// Checks `path`, then writes every row to `group` in file order, calling
/// `progress(done, total)` after each pipelined batch. The file's keys are of
/// the publisher's kind ([`Publisher::with_key_kind`]); with `link` (the
/// group's parent's key kind), each row names its parent after its key.
pub fn load_file(
    publisher: &mut Publisher,
    group: &str,
    path: &Path,
    link: Option<KeyKind>,
    mut progress: impl FnMut(usize, usize),
) -> Result<LoadSummary, FeedError> {
    check_group(group)?;
    let started = Instant::now();
    let kind = publisher.key_kind();
    let check = check_file_keyed(path, kind, link)?;
    let mut chunk: Vec<LinkedRow> = Vec::with_capacity(LOAD_CHUNK_ROWS.min(check.rows));
    let mut done = 0;
    let mut last_seq = 0;
    let mut dim = None;
    let mut flush = |chunk: &mut Vec<LinkedRow>, done: &mut usize| -> Result<(), FeedError> {
        let before = *done;
        let seq = publisher.put_many_linked(group, chunk, |n, _| progress(before + n, check.rows))?;
        last_seq = last_seq.max(seq);
        *done += chunk.len();
        chunk.clear();
        Ok(())
    };
    for_each_line(path, kind, link, &mut dim, |_, line| {
        if let Line::Row(key, values, parent) = line {
            chunk.push((key, values, parent));
            if chunk.len() == LOAD_CHUNK_ROWS {
                flush(&mut chunk, &mut done)?;
            }
        }
        Ok(())
    })?;
    if !chunk.is_empty() {
        flush(&mut chunk, &mut done)?;
    }
    Ok(LoadSummary {
        rows: done,
        dim: check.dim,
        defaults_skipped: check.defaults,
        last_seq,
        elapsed_s: started.elapsed().as_secs_f64(),
    })
}

fn input_err(path: &Path, line: usize, what: String) -> FeedError {
    FeedError::Input { path: path.display().to_string(), line, what }
}

/// Calls `f` with each meaningful line and its 1-based number, holding every line (the
/// `default` one included, as `replica build` does) to the dimension of the first.
fn for_each_line(
    path: &Path,
    kind: KeyKind,
    link: Option<KeyKind>,
    dim: &mut Option<usize>,
    mut f: impl FnMut(usize, Line) -> Result<(), FeedError>,
) -> Result<(), FeedError> {
    let io_err = |source| FeedError::Io { path: path.display().to_string(), source };
    let mut reader = BufReader::new(File::open(path).map_err(io_err)?);
    let mut text = String::new();
    let mut line_no = 0;
    loop {
        text.clear();
        line_no += 1;
        let n = reader.read_line(&mut text).map_err(|e| match e.kind() {
            std::io::ErrorKind::InvalidData => input_err(path, line_no, "not UTF-8 text".into()),
            _ => io_err(e),
        })?;
        if n == 0 {
            return Ok(());
        }
        let Some(line) = parse_line(&text, kind, link).map_err(|what| input_err(path, line_no, what))? else {
            continue;
        };
        let found = match &line {
            Line::Row(_, values, _) | Line::Default(values) => values.len(),
        };
        match *dim {
            None => *dim = Some(found),
            Some(d) if d != found => {
                return Err(input_err(path, line_no, format!("{found} values, earlier lines have {d}")));
            }
            Some(_) => {}
        }
        f(line_no, line)?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(name: &str, text: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("quiver-feed-load-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn lines_parse_like_replica_build() {
        let parse_line = |text| parse_line(text, KeyKind::U64, None);
        assert_eq!(parse_line("  # c\n").unwrap(), None);
        assert_eq!(parse_line("\n").unwrap(), None);
        assert_eq!(parse_line("7, 1.5 2\n").unwrap(), Some(Line::Row(EntityKeyBuf::Id(7), vec![1.5, 2.0], None)));
        assert_eq!(parse_line("default,0,0\n").unwrap(), Some(Line::Default(vec![0.0, 0.0])));
        assert!(parse_line("7\n").unwrap_err().contains("0 values"));
        assert!(parse_line("x,1\n").unwrap_err().contains("not an unsigned 64-bit id"));
        assert!(parse_line("1,abc\n").unwrap_err().contains("'abc' is not a number"));
        assert!(parse_line("1,inf\n").unwrap_err().contains("infinite"));
        // NaN marks a missing feature.
        assert!(matches!(parse_line("1,nan,2\n").unwrap(),
            Some(Line::Row(EntityKeyBuf::Id(1), v, None)) if v[0].is_nan() && v[1] == 2.0));
        assert!(parse_line(" , ,\n").unwrap_err().contains("only separators"));
    }

    #[test]
    fn replica_build_and_features_load_read_a_file_alike() {
        // One parser: the same lines are accepted, and the same line is
        // refused, by `quiver replica build` and `quiver features load`.
        let text = "# h\ndefault,0,0\n1,1,2\n,\n2,3,4\n";
        let p = file("separators.txt", text);
        let load = check_file(&p).unwrap_err().to_string();
        assert!(load.ends_with(":4: the line holds only separators; expected id,f0,f1,..."), "{load}");
        let Err(build) = crate::features::replica::ReplicaBuilder::from_text("user", text, &p.display().to_string())
        else {
            panic!("replica build accepted a line of separators");
        };
        assert_eq!(build.to_string(), load);
        let ok = "default,0,0\n1,1,2\n2,3,4\n";
        let p = file("ok2.txt", ok);
        assert_eq!(check_file(&p).unwrap(), FileCheck { rows: 2, dim: 2, defaults: 1 });
        assert!(crate::features::replica::ReplicaBuilder::from_text("user", ok, "ok2.txt").is_ok());
    }

    #[test]
    fn string_keyed_files_read_like_replica_build_key_bytes() {
        let kind = KeyKind::Str { bytes_max: 5 };
        let text = "# h\ndefault,0,0\nalice,1,2\n42 3 4\n";
        let p = file("str-ok.txt", text);
        assert_eq!(check_file_keyed(&p, kind, None).unwrap(), FileCheck { rows: 2, dim: 2, defaults: 1 });
        assert!(crate::features::replica::ReplicaBuilder::from_text_keyed("device", kind, text, "t").is_ok());
        assert_eq!(
            parse_line("42,1\n", kind, None).unwrap(),
            Some(Line::Row(EntityKeyBuf::Str(b"42".to_vec()), vec![1.0], None)),
            "digits are a string key in a string-keyed group"
        );
        let p = file("str-long.txt", "alice,1\nbernadette,2\n");
        let err = check_file_keyed(&p, kind, None).unwrap_err().to_string();
        assert!(err.ends_with(":2: key 'bernadette': a key of 10 bytes; this group's keys are 1 to 5 bytes"), "{err}");
        let p = file("str-dup.txt", "bob,1\nal,1\nbob,2\n");
        let err = check_file_keyed(&p, kind, None).unwrap_err().to_string();
        assert!(err.ends_with(":3: duplicate key bob (first on line 1)"), "{err}");
        let p = file("str-keys.txt", "# keys\nalice\n\n bob \n");
        assert_eq!(read_str_keys(&p, 5).unwrap(), vec![b"alice".to_vec(), b"bob".to_vec()]);
        let p = file("str-keys-long.txt", "alice\nbernadette\n");
        assert!(read_str_keys(&p, 5).unwrap_err().to_string().contains(":2: key 'bernadette'"));
    }

    #[test]
    fn check_names_the_bad_line() {
        let p = file("ok.txt", "# header\ndefault,0,0\n1,1,2\n\n2,3,4\n");
        assert_eq!(check_file(&p).unwrap(), FileCheck { rows: 2, dim: 2, defaults: 1 });

        let p = file("dim.txt", "1,1,2\n2,3\n");
        assert_eq!(
            check_file(&p).unwrap_err().to_string(),
            format!("{}:2: 1 values, earlier lines have 2", p.display())
        );
        let p = file("default-dim.txt", "default,0\n2,3,4\n");
        assert!(check_file(&p).unwrap_err().to_string().ends_with(":2: 2 values, earlier lines have 1"));
        let p = file("dup.txt", "5,1\n6,1\n5,2\n");
        assert!(check_file(&p).unwrap_err().to_string().ends_with(":3: duplicate id 5 (first on line 1)"));
        let p = file("empty.txt", "# nothing\n");
        assert!(check_file(&p).unwrap_err().to_string().ends_with("no rows"));
    }

    #[test]
    fn a_linked_groups_lines_name_the_parent_after_the_key() {
        let (ids, strs) = (KeyKind::U64, KeyKind::Str { bytes_max: 4 });
        let parse = |text, link| parse_line(text, ids, Some(link));
        let row = |parent: Option<EntityKeyBuf>| Some(Line::Row(EntityKeyBuf::Id(7), vec![1.0, 2.0], parent));
        assert_eq!(parse("7,spr,1,2", strs).unwrap(), row(Some(EntityKeyBuf::Str(b"spr".to_vec()))));
        assert_eq!(parse("7 - 1 2", strs).unwrap(), row(None));
        assert_eq!(parse("7,9,1,2", ids).unwrap(), row(Some(EntityKeyBuf::Id(9))));
        assert_eq!(parse("default,0,0", ids).unwrap(), Some(Line::Default(vec![0.0, 0.0])));
        assert!(parse("7,spring,1,2", strs).unwrap_err().contains("parent key 'spring' is 6 bytes"));
        assert!(parse("7,x,1,2", ids).unwrap_err().contains("'x' is not an unsigned 64-bit parent key"));
        assert!(parse("7", ids).unwrap_err().contains("no parent column"));
        assert!(parse("7,9", ids).unwrap_err().contains("0 values"));
        // The file check reads the same lines, and replica build does too.
        let p = file("linked.txt", "# ads\ndefault,0\n1,spr,0.5\n2,-,0.25\n1,aut,1\n");
        let err = check_file_keyed(&p, ids, Some(strs)).unwrap_err().to_string();
        assert!(err.ends_with(":5: duplicate id 1 (first on line 3)"), "{err}");
        let text = "default,0\n1,spr,0.5\n2,-,0.25\n";
        let b = crate::features::replica::ReplicaBuilder::from_text_linked("ad", ids, Some(strs), text, "t").unwrap();
        let out = std::env::temp_dir().join(format!("quiver-feed-load-{}/ad.qrep", std::process::id()));
        b.write(&out).unwrap();
        let h = crate::features::replica::ReplicaHandle::open(&out, "ad").unwrap();
        let (mut v, mut link) = ([0.0], vec![0; h.link_words()]);
        assert!(h.read_linked_into(1, &[], &mut v, &mut link));
        let mut buf = [0u8; 64];
        let parent = crate::features::replica::decode_link(&link, strs, &mut buf);
        assert_eq!((v, parent), ([0.5], Some(crate::features::replica::EntityKey::Str(b"spr"))));
        assert!(h.read_linked_into(2, &[], &mut v, &mut link));
        assert_eq!(crate::features::replica::decode_link(&link, strs, &mut buf), None);
    }
}
