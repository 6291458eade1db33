//! Embedding tables, owned or served in place from the model file.
//!
//! A graph model's `Embedding` tables can be millions of rows, gigabytes of
//! floats. `Model::load` maps the model file read-only ([`ModelFile`]) and
//! an [`EmbeddingTable`] cut from it is a view of the mapping: loading copies
//! none of it into the heap, and every clone of the model, its graph and
//! every per-shard backend share the one mapping (an `Arc`), so the table's
//! pages exist once, in the page cache. Tables of models built in memory
//! (the importers, tests) are owned instead; both deref to `&[f32]`.
//!
//! The floats are little-endian f32 in the file. A view reinterprets the
//! mapped bytes in place, so it is only made where that is exact: the bytes
//! 4-byte aligned in memory and the host little-endian; elsewhere a typed
//! [`TableError`] refuses the file rather than reading it wrong.

use std::fs::File;
use std::ops::Deref;
use std::sync::Arc;

/// Why a table cannot be served from the mapping.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TableError {
    #[error("its floats at byte {at} of the file are not 4-byte aligned in memory")]
    Misaligned { at: usize },
    #[error("this host is big-endian; the file's little-endian floats cannot be served in place")]
    BigEndian,
    #[error("its {floats} floats from byte {at} run past the end of the {file_bytes}-byte file (truncated?)")]
    OutOfFile { at: u64, floats: u64, file_bytes: u64 },
}

/// A model file mapped read-only, whole.
pub struct ModelFile {
    map: memmap2::Mmap,
}

impl ModelFile {
    /// Maps `file` read-only.
    ///
    /// # Safety
    ///
    /// While the returned mapping or any table cut from it lives, nothing
    /// may truncate `file` or write to it in place: reading a page a
    /// truncation removed raises SIGBUS, and a write in place changes
    /// floats that loading validated (and that safe code borrows as
    /// immutable). Replacing the file by renaming another over its path is
    /// fine: the mapping keeps the old inode.
    pub unsafe fn map(file: &File) -> std::io::Result<ModelFile> {
        // SAFETY: the caller upholds that the file is not changed in place.
        let map = unsafe { memmap2::Mmap::map(file) }?;
        Ok(ModelFile { map })
    }

    pub fn bytes(&self) -> &[u8] {
        &self.map
    }
}

impl std::fmt::Debug for ModelFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelFile").field("bytes", &self.map.len()).finish()
    }
}

/// The `[rows][dim]` floats of an embedding table; clones share them.
#[derive(Clone)]
pub struct EmbeddingTable(Floats);

#[derive(Clone)]
enum Floats {
    Owned(Arc<Vec<f32>>),
    /// `len` floats from byte `at` of `file`, checked by
    /// [`EmbeddingTable::mapped`] to lie in it, aligned, on a little-endian
    /// host. Private, so no other code can make one unchecked.
    Mapped {
        file: Arc<ModelFile>,
        at: usize,
        len: usize,
    },
}

impl EmbeddingTable {
    /// A view of the `floats` little-endian f32 at byte `at` of `file`.
    pub fn mapped(file: &Arc<ModelFile>, at: usize, floats: usize) -> Result<EmbeddingTable, TableError> {
        let bytes = file.bytes();
        in_file(bytes, at, floats)?;
        if cfg!(target_endian = "big") {
            return Err(TableError::BigEndian);
        }
        if !(bytes.as_ptr() as usize + at).is_multiple_of(std::mem::align_of::<f32>()) {
            return Err(TableError::Misaligned { at });
        }
        Ok(EmbeddingTable(Floats::Mapped { file: Arc::clone(file), at, len: floats }))
    }

    /// A copy of the `floats` little-endian f32 at byte `at` of `bytes`
    /// (a model file held in memory).
    pub fn copied(bytes: &[u8], at: usize, floats: usize) -> Result<EmbeddingTable, TableError> {
        let range = in_file(bytes, at, floats)?;
        let v = bytes[range].chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        Ok(EmbeddingTable(Floats::Owned(Arc::new(v))))
    }

    /// Whether the floats are served from a mapped model file.
    pub fn is_mapped(&self) -> bool {
        matches!(self.0, Floats::Mapped { .. })
    }

    /// The mapped file the floats are served from, if they are.
    pub fn file(&self) -> Option<&Arc<ModelFile>> {
        match &self.0 {
            Floats::Mapped { file, .. } => Some(file),
            Floats::Owned(_) => None,
        }
    }
}

/// The bytes of `floats` f32 at byte `at`, if `bytes` holds them all.
fn in_file(bytes: &[u8], at: usize, floats: usize) -> Result<std::ops::Range<usize>, TableError> {
    let end = floats.checked_mul(4).and_then(|n| n.checked_add(at));
    match end {
        Some(end) if end <= bytes.len() => Ok(at..end),
        _ => Err(TableError::OutOfFile { at: at as u64, floats: floats as u64, file_bytes: bytes.len() as u64 }),
    }
}

impl From<Vec<f32>> for EmbeddingTable {
    fn from(v: Vec<f32>) -> EmbeddingTable {
        EmbeddingTable(Floats::Owned(Arc::new(v)))
    }
}

impl Deref for EmbeddingTable {
    type Target = [f32];

    #[inline]
    fn deref(&self) -> &[f32] {
        match &self.0 {
            Floats::Owned(v) => v,
            Floats::Mapped { file, at, len } => {
                let bytes = &file.bytes()[*at..*at + *len * 4];
                // SAFETY: `mapped` checked that these bytes lie in the
                // mapping, start 4-byte aligned and that the host is
                // little-endian, as the file's floats are; every bit
                // pattern is an f32; the slice borrows `self`, which keeps
                // the mapping alive, and `ModelFile::map`'s caller promised
                // the bytes do not change while it is.
                unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<f32>(), *len) }
            }
        }
    }
}

impl PartialEq for EmbeddingTable {
    fn eq(&self, other: &EmbeddingTable) -> bool {
        **self == **other
    }
}

impl std::fmt::Debug for EmbeddingTable {
    // Millions of floats help no one reading a debug print.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddingTable").field("floats", &self.len()).field("mapped", &self.is_mapped()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_of(bytes: &[u8]) -> Arc<ModelFile> {
        let path = std::env::temp_dir().join(format!("quiver-table-{}.bin", std::process::id()));
        std::fs::write(&path, bytes).unwrap();
        // SAFETY: the file is private to this test and only removed (its
        // inode stays mapped), never written again.
        let file = Arc::new(unsafe { ModelFile::map(&File::open(&path).unwrap()) }.unwrap());
        std::fs::remove_file(&path).unwrap();
        file
    }

    #[test]
    fn a_view_reads_the_file_in_place_and_refuses_bad_ranges() {
        let floats = [1.5f32, -2.0, 3.25];
        let mut bytes = vec![0u8; 4];
        bytes.extend(floats.iter().flat_map(|v| v.to_le_bytes()));
        let file = file_of(&bytes);
        let t = EmbeddingTable::mapped(&file, 4, 3).unwrap();
        assert_eq!(&*t, &floats);
        assert!(t.is_mapped() && file.bytes().as_ptr_range().contains(&t.as_ptr().cast()));
        assert_eq!(t, EmbeddingTable::from(floats.to_vec()));
        let again = t.clone();
        assert_eq!(again.as_ptr(), t.as_ptr());
        assert_eq!(
            EmbeddingTable::mapped(&file, 4, 4).unwrap_err(),
            TableError::OutOfFile { at: 4, floats: 4, file_bytes: 16 }
        );
        assert!(matches!(EmbeddingTable::mapped(&file, 8, usize::MAX), Err(TableError::OutOfFile { .. })));
        assert_eq!(EmbeddingTable::mapped(&file, 2, 1).unwrap_err(), TableError::Misaligned { at: 2 });
        let copy = EmbeddingTable::copied(file.bytes(), 4, 3).unwrap();
        assert!(!copy.is_mapped() && copy == t && copy.file().is_none());
        assert!(matches!(EmbeddingTable::copied(file.bytes(), 5, 3), Err(TableError::OutOfFile { .. })));
    }
}
