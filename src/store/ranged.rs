//! Ranged reads as a store sees them: which object, which bytes, and a sink that takes the
//! bytes in order as they arrive. A backend fills [`RangeSink`]s and knows nothing of what
//! they are for; the reader's fetches (`checkpoint::Fetch`, which sum CRC pieces as the
//! bytes land) implement the trait.

use std::ops::Range;

/// [`RangeSink::write`] was handed more bytes than the read asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Overflow;

/// One ranged read in progress: object `object()` (an index into the caller's list of
/// objects), bytes `range()`, written into the sink in order.
pub trait RangeSink {
    /// The index of the object to read, in the list the caller passed with the reads.
    fn object(&self) -> usize;

    /// The absolute byte range of the object to read.
    fn range(&self) -> Range<u64>;

    /// Append the next bytes of the range.
    ///
    /// # Errors
    /// [`Overflow`] (and nothing written) if `bytes` run past the end of the range.
    fn write(&mut self, bytes: &[u8]) -> Result<(), Overflow>;

    /// Bytes written so far.
    fn landed(&self) -> usize;

    /// Whether every byte asked for has been written.
    fn is_complete(&self) -> bool;
}
