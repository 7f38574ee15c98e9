"""The network and how one step runs on it: layers, paged attention (kernels), weight
loading, CUDA graphs, the model runner."""
