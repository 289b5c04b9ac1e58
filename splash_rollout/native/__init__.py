"""Native CPU kernels, compiled for the machine at first use (``build.py``).

``paged_mla.cpp`` is the ``cpu`` attention backend's kernel; ``small_matmul.cpp`` computes the
products with few activation rows that decode steps and routed experts are made of;
``routed_experts.cpp`` a MoE block's experts in one call; ``fused_rows.cpp`` RMSNorm and the rotary
embedding in one pass each; ``sample_rows.cpp`` the sampler's rows without truncation; ``expanded_attention.cpp`` a prefill
chunk's attention in expanded form.
"""
from splash_rollout.native.build import NativeUnavailable, load_native, native_available

__all__ = ["NativeUnavailable", "load_native", "native_available"]
