//! A zero-initialised buffer of plain numbers whose start is 64-byte aligned.
//!
//! Packed weights and quantized activations are read with full-width vector
//! loads; starting every buffer on a cache line keeps those loads from
//! straddling two lines. `Vec<T>` only promises `align_of::<T>()`, so the
//! storage is a vector of 64-byte blocks viewed as a slice of `T`.

use std::marker::PhantomData;

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Block([u8; 64]);

/// Element types for which every bit pattern is a valid value and zero bytes
/// mean zero, so viewing zeroed blocks as `[T]` is sound.
///
/// # Safety
/// Implement only for primitive integer and float types.
pub unsafe trait Plain: Copy {}
// SAFETY: primitive numbers: no padding, no invalid bit patterns.
unsafe impl Plain for i8 {}
// SAFETY: as above.
unsafe impl Plain for u8 {}
// SAFETY: as above.
unsafe impl Plain for i16 {}
// SAFETY: as above.
unsafe impl Plain for i32 {}
// SAFETY: as above.
unsafe impl Plain for f32 {}

pub struct AlignedBuf<T: Plain> {
    blocks: Vec<Block>,
    len: usize,
    _elem: PhantomData<T>,
}

impl<T: Plain> AlignedBuf<T> {
    /// `len` zeros.
    pub fn zeroed(len: usize) -> AlignedBuf<T> {
        let bytes = len * std::mem::size_of::<T>();
        AlignedBuf { blocks: vec![Block([0; 64]); bytes.div_ceil(64)], len, _elem: PhantomData }
    }

    pub fn as_slice(&self) -> &[T] {
        // SAFETY: the blocks hold at least `len * size_of::<T>()` initialised
        // bytes, 64-byte alignment satisfies any `T: Plain`, and every bit
        // pattern is a valid `T`.
        unsafe { std::slice::from_raw_parts(self.blocks.as_ptr().cast::<T>(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as in `as_slice`; `&mut self` makes the view unique.
        unsafe { std::slice::from_raw_parts_mut(self.blocks.as_mut_ptr().cast::<T>(), self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_on_a_cache_line_and_reads_back_what_was_written() {
        let mut b = AlignedBuf::<i16>::zeroed(100);
        assert_eq!(b.as_slice().as_ptr() as usize % 64, 0);
        assert!(b.as_slice().iter().all(|&v| v == 0));
        b.as_mut_slice()[99] = -7;
        assert_eq!(b.as_slice()[99], -7);
        assert_eq!(b.as_slice().len(), 100);
    }
}
