"""The tinygrad models the worker loads (BERT encoders, cross-encoders, llama decoders) and the CPU's fused C
kernels. The worker's own modules, not an API."""
