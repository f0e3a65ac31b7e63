//! Load-time work (rewriting a GGUF's blocks, packing them for the kernels) split over scoped
//! threads: each thread writes its own contiguous range of the output, so the result does not
//! depend on the thread count. Most of that time is first-touched pages of the outputs, which
//! fault in parallel too.
//!
//! Invariants: [`split`] calls `job` on ranges that cover `0..items` exactly once; an [`Out`]
//! range is only handed to the thread that owns those items.

/// The threads a load uses: the CPUs this process may run on (at most 16).
pub fn load_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().min(16))
}

/// Runs `job(first item, item count)` over `items` items split into contiguous ranges on up to
/// `threads` scoped threads (the caller's thread takes the first range).
pub fn split<F: Fn(usize, usize) + Sync>(items: usize, threads: usize, job: F) {
    let threads = threads.clamp(1, items.max(1));
    let per = items.div_ceil(threads);
    std::thread::scope(|scope| {
        for t in 1..threads {
            let job = &job;
            let start = (t * per).min(items);
            let count = per.min(items - start);
            scope.spawn(move || job(start, count));
        }
        job(0, per.min(items));
    });
}

/// An output slice's pointer shared by the threads of [`split`], each writing its own range.
pub struct Out<T>(pub *mut T);
// (not derived: a derive would ask `T: Copy`, and a pointer copies whatever it points to)
impl<T> Clone for Out<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Out<T> {}
// SAFETY: the threads write disjoint ranges (the module's invariant)
unsafe impl<T> Send for Out<T> {}
unsafe impl<T> Sync for Out<T> {}

impl<T> Out<T> {
    /// `len` elements from `start`.
    ///
    /// # Safety
    /// The ranges of concurrent callers do not overlap and lie inside the slice this was made
    /// from, which outlives them.
    pub unsafe fn range<'a>(self, start: usize, len: usize) -> &'a mut [T] {
        std::slice::from_raw_parts_mut(self.0.add(start), len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_covers_every_block_once() {
        for (blocks, threads) in [(0, 2), (1, 4), (7, 2), (8, 3), (100, 16)] {
            let seen: Vec<_> = (0..blocks)
                .map(|_| std::sync::atomic::AtomicUsize::new(0))
                .collect();
            split(blocks, threads, |first, count| {
                for s in &seen[first..first + count] {
                    s.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            });
            assert!(seen
                .iter()
                .all(|s| s.load(std::sync::atomic::Ordering::Relaxed) == 1));
        }
    }
}
