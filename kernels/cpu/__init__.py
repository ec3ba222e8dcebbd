"""The compiled CPU expert kernels (a torch C++ extension, AVX-512 or AVX2, chosen at run time):
`moe_mlp_cpu` runs the routed expert MLP over weights read in place in their stored format, `linear_cpu`
dense matmuls at decode sizes, `step_ops` the decode step's small operations (norms, rope, decode
attention, routing plan), `quantize_cpu` the weight formats' quantizers (quantize on load)."""
