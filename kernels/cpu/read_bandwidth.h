// The machine's memory read bandwidth as the CPU kernels see it: the roofline
// that weight-streaming decode is held against (`pdserve bench engine`).
#pragma once

namespace pdserve::kernels {

// Bytes per second that `threads` threads (the caller counted) read from a
// buffer far larger than the last-level cache, each summing its own slice
// with the widest loads this processor has; the best of several passes.
// Takes about a second and 256 MiB of memory.
double MeasureReadBandwidth(int threads);

}  // namespace pdserve::kernels
