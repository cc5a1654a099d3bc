"""Hugging Face Accelerate's Transformer Engine path on te-core, with small Llama and OPT models.

After te_core.install_as_transformer_engine(), Accelerate finds "transformer-engine" installed,
and its own code (convert_model, apply_fp8_autowrap, Accelerator(mixed_precision="fp8").prepare)
swaps the model's nn.Linear layers for te-core's and trains it under FP8 delayed scaling; here on
the reference backend (CPU). te_core.convert_model on the same model is checked the same way.
Needs the test extra: `pip install 'te-core[hf]'` (transformers and accelerate).
"""
from __future__ import annotations

import copy
import importlib.metadata
import os
import warnings
from contextlib import contextmanager, nullcontext

import pytest
import torch
from torch import nn

import te_core
from te_core.compat.transformer_engine import uninstall_transformer_engine


HINT = "needs the test extra: pip install 'te-core[hf]'"
transformers = pytest.importorskip("transformers", minversion="4.44", reason=f"transformers is not installed; {HINT}")
accelerate = pytest.importorskip("accelerate", minversion="1.4", reason=f"accelerate is not installed; {HINT}")
from accelerate.state import AcceleratorState  # noqa: E402
from accelerate.utils import TERecipeKwargs  # noqa: E402
from accelerate.utils import transformer_engine as accelerate_te  # noqa: E402

VOCAB, TOKENS, STEPS = 128, (2, 16), 6  # 32 tokens: FP8 GEMMs need row counts that are multiples of 16
E4M3 = dict(rtol=0.125, atol=0.0675)
FP32 = dict(rtol=1.3e-6, atol=1e-5)
RECIPE = dict(fp8_format="HYBRID", amax_history_len=16, amax_compute_algo="max")  # Accelerate's TERecipeKwargs


@pytest.fixture
def accelerator_state():
    """Accelerate keeps one process-wide state (and sets environment variables); each test starts
    and ends without them."""
    environ = dict(os.environ)
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    os.environ.clear()
    os.environ.update(environ)


# Every Linear's dimensions are multiples of 16, as Accelerate's convert_model requires (it stops
# converting at the first Linear that is not). Llama normalizes with its own RMSNorm, OPT with nn.LayerNorm.
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=128, num_key_value_heads=2)),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(ffn_dim=128, word_embed_proj_dim=64)),
}


def hf_model(architecture: str = "llama", seed: int = 0) -> nn.Module:
    """A small causal LM of that architecture, built from a config (no download)."""
    config_cls, model_cls, extra = ARCHITECTURES[architecture]
    cfg = getattr(transformers, config_cls)(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, max_position_embeddings=64, **extra)
    torch.manual_seed(seed)
    return getattr(transformers, model_cls)(cfg)


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, TOKENS, generator=torch.Generator().manual_seed(seed))


def names_of(model: nn.Module, cls: type):
    return [name for name, m in model.named_modules() if type(m) is cls]


def train(model: nn.Module, optimizer, step_context=nullcontext, backward=None) -> torch.Tensor:
    """STEPS optimizer steps on one batch (a model must be able to fit it); the losses."""
    batch, losses = tokens(), []
    model.train()
    for _ in range(STEPS):
        with step_context():
            loss = model(batch, labels=batch).loss
        (backward or torch.Tensor.backward)(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().float())
    return torch.stack(losses)


def assert_fp8_trained(model: nn.Module, losses: torch.Tensor, bf16_losses: torch.Tensor) -> None:
    """The te-core Linears ran FP8 casts (scales moved off their initial 1), the loss fell, and each
    step's loss, and the progress since the first step, are within E4M3's tolerance of the BF16 run's."""
    linears = [m for m in model.modules() if isinstance(m, te_core.Linear)]
    assert linears
    for layer in linears:
        state = layer.quantization_state()
        for direction, role in (("forward", "input"), ("forward", "weight"), ("backward", "grad_output")):
            assert state[direction][role]["amax_history"].abs().sum() > 0, f"{direction} {role}: no amax recorded"
            assert not torch.all(state[direction][role]["scale"] == 1), f"{direction} {role}: scale never updated"
    assert torch.isfinite(losses).all() and losses[-1] < losses[0], f"FP8 losses did not fall: {losses}"
    torch.testing.assert_close(losses, bf16_losses, **E4M3,
                               msg=lambda m: f"FP8 losses {losses} vs BF16 {bf16_losses}: {m}")
    progress, bf16_progress = losses[1:] - losses[0], bf16_losses[1:] - bf16_losses[0]
    torch.testing.assert_close(progress, bf16_progress, **E4M3, msg=lambda m: f"loss decrease vs BF16's: {m}")


@contextmanager
def no_fp8_autocast_deprecation():
    """Accelerate calls TE's fp8_autocast, which te-core keeps as a deprecated alias of autocast."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="fp8_autocast is deprecated", category=DeprecationWarning)
        yield


def test_accelerate_sees_the_stand_in(stand_in):
    import transformer_engine.pytorch as te

    from accelerate.utils import is_transformer_engine_available

    assert is_transformer_engine_available() and te is stand_in
    assert importlib.metadata.version("transformer-engine") == te.__version__  # what Accelerate looks up
    if hasattr(accelerate.utils, "is_transformer_engine_mxfp8_available"):
        assert accelerate.utils.is_transformer_engine_mxfp8_available() == te.is_mxfp8_available()
    uninstall_transformer_engine()
    assert not is_transformer_engine_available()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_accelerate_convert_model_swaps_linears_and_layernorms(stand_in, accelerator_state, architecture, dtype):
    """Accelerate's convert_model replaces every nn.Linear and nn.LayerNorm by te-core's (Llama's
    RMSNorms it leaves alone). In float32 the logits equal the unconverted model's; in bf16, where
    two valid roundings differ by an ulp, they are as close to the float32 model's as the
    unconverted bf16 model's are (largest and mean error, within bf16's relative tolerance)."""
    accelerate.Accelerator(cpu=True)  # convert_model reads the accelerator's state
    original = hf_model(architecture).to(dtype).eval()
    model = copy.deepcopy(original)
    with torch.no_grad():
        accelerate_te.convert_model(model)
    converted = dict(model.named_modules())
    for cls, te_cls in ((nn.Linear, stand_in.Linear), (nn.LayerNorm, stand_in.LayerNorm)):
        assert all(type(converted[n]) is te_cls and converted[n].weight.dtype == dtype for n in names_of(original, cls))
    assert names_of(original, nn.Linear) and accelerate_te.has_transformer_engine_layers(model)
    if architecture == "llama":
        assert type(model.model.norm).__name__ == "LlamaRMSNorm"
    else:
        assert names_of(original, nn.LayerNorm)
    batch = tokens()
    got, want = model(batch).logits, original(batch).logits
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, **FP32)
        return
    exact = hf_model(architecture).eval()(batch).logits.double()
    for stat in (torch.max, torch.mean):
        err, original_err = stat((got.double() - exact).abs()), stat((want.double() - exact).abs())
        assert err <= original_err * (1 + 1.6e-2), f"{stat.__name__} error {err:.3g}, the original's {original_err:.3g}"


def test_accelerator_fp8_prepare_trains_like_bf16(stand_in, accelerator_state):
    """Accelerator(mixed_precision="fp8").prepare converts the model (convert_model) and wraps its
    forward in TE's fp8_autocast (apply_fp8_autowrap); training then tracks an Accelerate BF16 run."""
    bf16 = accelerate.Accelerator(mixed_precision="bf16", cpu=True)
    plain = hf_model()
    model, optimizer = bf16.prepare(plain, torch.optim.AdamW(plain.parameters(), lr=1e-3))
    bf16_losses = train(model, optimizer, backward=bf16.backward)

    AcceleratorState._reset_state(reset_partial_state=True)
    fp8 = accelerate.Accelerator(mixed_precision="fp8", cpu=True, kwargs_handlers=[TERecipeKwargs(**RECIPE)])
    plain = hf_model()
    names = names_of(plain, nn.Linear)
    model, optimizer = fp8.prepare(plain, torch.optim.AdamW(plain.parameters(), lr=1e-3))
    assert names and all(type(m) is stand_in.Linear for n, m in model.named_modules() if n in names)
    # the optimizer steps the converted model's parameters, not the replaced layers'
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {id(p) for p in model.parameters()}
    with no_fp8_autocast_deprecation():
        losses = train(model, optimizer, backward=fp8.backward)
    assert_fp8_trained(model, losses, bf16_losses)


def test_apply_fp8_autowrap_runs_fp8_only_in_training(stand_in, accelerator_state):
    """apply_fp8_autowrap's forward enters TE's fp8_autocast in training mode only (by default)."""
    from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

    accelerate.Accelerator(cpu=True)
    model = hf_model()
    with torch.no_grad():
        accelerate_te.convert_model(model)
    seen = []
    model.model.layers[0].mlp.register_forward_hook(lambda *_: seen.append(FP8GlobalStateManager.is_fp8_enabled()))
    accelerate_te.apply_fp8_autowrap(model, TERecipeKwargs(**RECIPE))
    with no_fp8_autocast_deprecation():
        model.eval()(tokens())
        model.train()(tokens())
    assert seen == [False, True]
    assert model.forward.__wrapped__ is not None  # Accelerate unwraps it again through this attribute


def test_te_core_convert_model_on_llama():
    """te_core.convert_model swaps the Linears and the LlamaRMSNorms; high precision equals the
    original model, and FP8 training under te_core.autocast tracks a BF16 (torch.autocast) run."""
    original = hf_model().eval()
    model = copy.deepcopy(original)
    te_core.convert_model(model)
    modules = dict(model.named_modules())
    assert all(type(modules[n]) is te_core.Linear for n in names_of(original, nn.Linear))
    norms = [n for n, m in original.named_modules() if type(m).__name__ == "LlamaRMSNorm"]
    assert norms and all(type(modules[n]) is te_core.RMSNorm for n in norms)
    batch = tokens()
    torch.testing.assert_close(model(batch).logits, original(batch).logits, **FP32)

    plain = hf_model()
    bf16_losses = train(plain, torch.optim.AdamW(plain.parameters(), lr=1e-3),
                        lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    recipe = te_core.recipe.DelayedScaling(fp8_format=te_core.recipe.Format.HYBRID, amax_history_len=16,
                                           amax_compute_algo="max")  # RECIPE, as Accelerate passes it on
    losses = train(model, torch.optim.AdamW(model.parameters(), lr=1e-3), lambda: fp8_in_bf16(recipe))
    assert_fp8_trained(model, losses, bf16_losses)


@contextmanager
def fp8_in_bf16(recipe):
    """te_core.autocast(recipe) inside torch.autocast(bf16): what Accelerate's FP8 path runs."""
    with torch.autocast("cpu", dtype=torch.bfloat16), te_core.autocast(recipe=recipe):
        yield


def _enable_checkpointing(model: nn.Module, kwargs=None) -> None:
    """Hugging Face's activation checkpointing (named gradient checkpointing before transformers 5)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def test_activation_checkpointing_of_a_converted_model():
    """Hugging Face's activation checkpointing runs torch.utils.checkpoint, which does not restore
    te.autocast: given te_core.checkpoint_context it recomputes FP8-exactly (the same losses and
    gradients as without checkpointing); without it, the backward raises instead of returning
    the gradients of a high-precision recompute."""
    recipe = te_core.recipe.DelayedScaling(amax_history_len=4)
    plain = te_core.convert_model(hf_model())
    checkpointed = copy.deepcopy(plain)
    _enable_checkpointing(checkpointed, {"use_reentrant": False, "context_fn": te_core.checkpoint_context})
    batch = tokens()
    for step in range(3):
        grads = []
        for model in (plain, checkpointed):
            model.train()
            with te_core.autocast(recipe=recipe):
                loss = model(batch, labels=batch).loss
            loss.backward()
            grads.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
            model.zero_grad(set_to_none=True)
        for i, (got, want) in enumerate(zip(grads[1], grads[0])):
            assert torch.equal(got, want), f"step {step}, tensor {i}"

    unwrapped = copy.deepcopy(plain)
    _enable_checkpointing(unwrapped)
    unwrapped.train()
    with te_core.autocast(recipe=recipe):
        loss = unwrapped(batch, labels=batch).loss
    with pytest.raises(RuntimeError, match="checkpoint_context"):
        loss.backward()


def test_save_pretrained_of_a_converted_model_keeps_weights_and_scaling_state(tmp_path):
    """save_pretrained writes safetensors, which hold tensors only: te-core's extra state is a
    uint8 tensor (as Transformer Engine's), so a converted model saves after FP8 training, and
    the file restores its weights and delayed-scaling state exactly."""
    from safetensors.torch import load_file

    model = te_core.convert_model(hf_model())
    recipe = te_core.recipe.DelayedScaling(amax_history_len=4)
    train(model, torch.optim.AdamW(model.parameters(), lr=1e-3), lambda: te_core.autocast(recipe=recipe))
    model.save_pretrained(tmp_path)
    files = list(tmp_path.glob("*.safetensors"))
    assert files
    saved = {k: v for f in files for k, v in load_file(f).items()}
    restored = te_core.convert_model(hf_model(seed=5))
    restored.load_state_dict(saved, strict=False)
    for (name, a), (_, b) in zip(model.named_parameters(), restored.named_parameters()):
        assert torch.equal(a, b), name
    linears = [n for n, m in model.named_modules() if isinstance(m, te_core.Linear)]
    assert linears
    for name in linears:
        want = dict(model.named_modules())[name].quantization_state()
        got = dict(restored.named_modules())[name].quantization_state()
        assert want["forward"] and got.keys() == want.keys()
        for direction in want:
            for slot, entry in want[direction].items():
                for key, value in entry.items():
                    assert torch.equal(got[direction][slot][key], value), (name, direction, slot, key)
