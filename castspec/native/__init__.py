"""castspec's native backend for AVX-512 CPUs: building the C library (build), linear products (linear) and whole
forwards of a few rows (forward); the C sources are in csrc/."""
