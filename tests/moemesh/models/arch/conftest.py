"""The families' variants (tiny checkpoints from tests/fixtures/checkpoints.py) with their transformers
outputs, and natively quantized copies, each built once per session."""
import pytest

from tests.moemesh.models.arch.native_quant import write_fp8_block, write_mxfp4, write_nvfp4
from tests.moemesh.models.arch.reference import greedy, prompt_logprobs

PROMPTS = ((5, 17, 301, 42, 9, 77, 123, 250, 3, 64, 11), (400, 2, 2, 2, 99))
GREEDY_TOKENS = 32

# arch -> config overrides; the second variant of each family flips its options
VARIANTS = {
    "deepseek_v3": ("deepseek_v3", {}),
    # Kimi-K2-like: no q LoRA, one group, rotate-half rope without YaRN, no top-k renormalization
    "deepseek_v3_plain": ("deepseek_v3", dict(q_lora_rank=None, n_group=1, topk_group=1, rope_interleave=False,
                                              rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
                                              norm_topk_prob=False, first_k_dense_replace=2)),
    "glm4_moe": ("glm4_moe", {}),
    "glm4_moe_plain": ("glm4_moe", dict(use_qk_norm=False, attention_bias=False, partial_rotary_factor=0.25,
                                        n_group=1, topk_group=1, n_shared_experts=2)),
    "gpt_oss": ("gpt_oss", {}),
}


def build_variant(name: str, tiny_ckpt):
    """(path, transformers model, {prompt: (prompt logprobs, greedy continuation)}) for PROMPTS."""
    arch, overrides = VARIANTS[name]
    path, model = tiny_ckpt(arch, **overrides)
    expected = {p: (prompt_logprobs(model, list(p)), greedy(model, list(p), GREEDY_TOKENS)) for p in PROMPTS}
    return path, model, expected


@pytest.fixture(scope="session")
def build_tiny(tiny_ckpt):
    """name -> build_variant(name), each variant built at most once per session."""
    built = {}

    def get(name: str):
        if name not in built:
            built[name] = build_variant(name, tiny_ckpt)
        return built[name]

    return get


@pytest.fixture
def tiny_checkpoint(request, build_tiny):
    """Indirectly parametrized with a VARIANTS name."""
    return build_tiny(request.param)


# native format -> (arch, config overrides, writer)
NATIVE = {
    # moe_intermediate 40, intermediate 72, q_lora 40 with 32x32 blocks: partial edge blocks in both dims
    "fp8": ("deepseek_v3", dict(moe_intermediate_size=40, intermediate_size=72, q_lora_rank=40),
            lambda src, dst: write_fp8_block(src, dst, (32, 32))),
    "nvfp4": ("deepseek_v3", {}, write_nvfp4),
    "mxfp4": ("gpt_oss", {}, write_mxfp4),
}


@pytest.fixture(scope="session")
def build_native(tiny_ckpt, tmp_path_factory):
    """format -> (format, quantized dir, dequantized-reference dir, unquantized transformers model,
    unquantized dir), each built at most once per session."""
    built = {}

    def get(fmt: str):
        if fmt not in built:
            arch, overrides, writer = NATIVE[fmt]
            root = tmp_path_factory.mktemp(f"native_{fmt}")
            src, model = tiny_ckpt(arch, **overrides)
            qdir, deq_dir = writer(src, root / "quantized")
            built[fmt] = (fmt, qdir, deq_dir, model, src)
        return built[fmt]

    return get


@pytest.fixture(scope="module")
def native_checkpoint(request, build_native):
    """Indirectly parametrized with a NATIVE format."""
    return build_native(request.param)
