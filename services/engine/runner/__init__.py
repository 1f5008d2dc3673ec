"""Model runner: persistent step inputs, CUDA graphs, memory planning."""
