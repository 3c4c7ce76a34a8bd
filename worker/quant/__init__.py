"""Weight-only quantized linear layers: the stored format (:mod:`worker.quant.format`), how weights
get into it (quantized at load, or read from a pre-quantized file) and the kernels that multiply by it."""
