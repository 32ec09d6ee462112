"""Native CPU kernels, compiled on first use with the machine's C++ compiler and cached."""
