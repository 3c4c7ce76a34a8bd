"""Sizing a deployment before anything runs: model shape, memory sizing, layouts (data parallel,
tensor parallel, layer split), placement on the discovered hardware, the plan and its report,
``doctor``'s checks and the GPU interconnect."""
