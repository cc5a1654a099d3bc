"""Lightning Fabric's Transformer Engine precision plugin on te-core, on the reference backend (CPU).

After te_core.install_as_transformer_engine(), Lightning's own TransformerEnginePrecision finds
"transformer-engine" installed, swaps a model's nn.Linear / nn.LayerNorm layers for te-core's and
runs its forward under TE's fp8_autocast (DelayedScaling); Fabric(precision="transformer-engine")
and PyTorch Lightning's Trainer(precision="transformer-engine") train with it. The plugin's
fallback autocast is torch.autocast("cuda"), which torch disables (with a warning) on a machine
without CUDA: the FP8 layers are what these tests check.
Needs the test extra: `pip install 'te-core[lightning]'` (lightning-fabric); the Trainer test
needs the full `lightning` package.
"""
from __future__ import annotations

import copy
import importlib
import warnings
from contextlib import contextmanager

import pytest
import torch
from torch import nn

import te_core
from te_core.compat.transformer_engine import uninstall_transformer_engine


HINT = "needs the test extra: pip install 'te-core[lightning]'"
try:
    fabric_package = importlib.import_module("lightning.fabric")
except ImportError:
    fabric_package = pytest.importorskip("lightning_fabric", reason=f"Lightning Fabric is not installed; {HINT}")
te_plugin = importlib.import_module(f"{fabric_package.__name__}.plugins.precision.transformer_engine")
Fabric, TransformerEnginePrecision = fabric_package.Fabric, te_plugin.TransformerEnginePrecision
from lightning_utilities.core.imports import RequirementCache  # noqa: E402  (a Lightning dependency)

E4M3 = dict(rtol=0.125, atol=0.0675)
FP32 = dict(rtol=1.3e-6, atol=1e-5)
STEPS = 8
RECIPE = dict(fp8_format="HYBRID", amax_history_len=16, amax_compute_algo="max")  # the plugin's dict form


@pytest.fixture
def fresh_availability(monkeypatch):
    """Lightning caches its `transformer_engine>=0.11.0` requirement check at its first use in the
    process; each test asks it afresh, so installing and removing the stand-in is seen."""
    requirement = te_plugin._TRANSFORMER_ENGINE_AVAILABLE.requirement
    monkeypatch.setattr(te_plugin, "_TRANSFORMER_ENGINE_AVAILABLE", RequirementCache(requirement))


@contextmanager
def expected_warnings():
    """The two warnings the plugin's forward_context raises here, by design: its fallback
    torch.autocast("cuda") is disabled without CUDA, and it calls the deprecated fp8_autocast."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*CUDA is not available.*Disabling autocast", category=UserWarning)
        warnings.filterwarnings("ignore", message="fp8_autocast is deprecated", category=DeprecationWarning)
        yield


def small_model(seed: int = 0) -> nn.Module:
    """Linear / LayerNorm / GELU with dimensions that are multiples of 16 (the plugin converts those)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 16))


def problem(seed: int = 1):
    """A fixed regression batch: 32 rows (FP8 GEMMs need multiples of 16) and a nonlinear target."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 32, generator=g)
    return x, torch.tanh(x @ torch.randn(32, 16, generator=g) / 4)


def assert_scaling_advanced(model: nn.Module) -> None:
    """Every te-core Linear recorded amaxes of its FP8 casts, forward (input, weight) and backward."""
    linears = [m for m in model.modules() if isinstance(m, te_core.Linear)]
    assert len(linears) == 2
    for layer in linears:
        state = layer.quantization_state()
        for direction, role in (("forward", "input"), ("forward", "weight"), ("backward", "grad_output")):
            assert state[direction][role]["amax_history"].abs().sum() > 0, f"{direction} {role}: no amax recorded"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plugin_converts_layers_and_runs_fp8(stand_in, fresh_availability, dtype):
    """convert_module swaps Linear and LayerNorm for te-core's, weights copied exactly (then cast to
    weights_dtype); outside FP8 the converted model computes what the original does; forward_context
    runs te-core's FP8 autocast with the plugin's DelayedScaling recipe."""
    plugin = TransformerEnginePrecision(weights_dtype=dtype, recipe=RECIPE, replace_layers=True)
    assert plugin.recipe == te_core.recipe.DelayedScaling(fp8_format=te_core.recipe.Format.HYBRID,
                                                          amax_history_len=16, amax_compute_algo="max")
    original = small_model()
    model = plugin.convert_module(copy.deepcopy(original))
    assert [type(m) for m in model] == [stand_in.Linear, stand_in.LayerNorm, nn.GELU, stand_in.Linear]
    for (name, got), want in zip(model.named_parameters(), original.parameters()):
        assert got.dtype == dtype and torch.equal(got, want.to(dtype)), f"{name} was not copied exactly"
    x, _ = problem()
    expected = original.to(dtype)(x.to(dtype))
    torch.testing.assert_close(model(plugin.convert_input(x)), expected, **(FP32 if dtype == torch.float32 else
                                                                            dict(rtol=1.6e-2, atol=1e-5)))

    from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

    with expected_warnings(), plugin.forward_context():
        assert FP8GlobalStateManager.is_fp8_enabled() and FP8GlobalStateManager.get_fp8_recipe() is plugin.recipe
        out = model(plugin.convert_input(x))
    plugin.convert_output(out).square().mean().backward()
    assert not FP8GlobalStateManager.is_fp8_enabled()
    assert out.dtype == dtype
    assert_scaling_advanced(model)
    torch.testing.assert_close(out.float(), expected.float(), **E4M3)


def test_init_module_builds_te_core_layers(stand_in, fresh_availability):
    """Under Fabric.init_module() with replace_layers=True, nn.Linear / nn.LayerNorm construct te-core's."""
    fabric = Fabric(accelerator="cpu", devices=1,
                    plugins=[TransformerEnginePrecision(weights_dtype=torch.bfloat16, replace_layers=True)])
    with fabric.init_module():
        model = small_model()
    assert [type(m) for m in model] == [stand_in.Linear, stand_in.LayerNorm, nn.GELU, stand_in.Linear]
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def fabric_losses(fabric):
    """STEPS Adam steps on the fixed problem under Fabric: the losses and the set-up model. The
    optimizer is made after setup_module, since the plugin's conversion replaces the layers (and
    their parameters)."""
    model = fabric.setup_module(small_model())
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))
    x, y = problem()
    losses = []
    for _ in range(STEPS):
        with expected_warnings():
            loss = nn.functional.mse_loss(model(x).float(), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses), model


@pytest.mark.parametrize("precision, te_precision", [
    ("bf16-true", "transformer-engine"),  # Fabric's own name: bf16 weights
    ("32-true", TransformerEnginePrecision),  # the plugin object, float32 weights
], ids=["precision=transformer-engine", "plugins=TransformerEnginePrecision"])
def test_fabric_fp8_training_tracks_high_precision(stand_in, fresh_availability, precision, te_precision):
    """Fabric with the TE plugin trains the model under FP8; the loss falls, and each step's loss and
    the progress since the first step are within E4M3's tolerance of Fabric's run without FP8
    at the same weights dtype."""
    baseline, _ = fabric_losses(Fabric(accelerator="cpu", devices=1, precision=precision))
    if te_precision is TransformerEnginePrecision:
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[te_precision(weights_dtype=torch.float32)])
    else:
        fabric = Fabric(accelerator="cpu", devices=1, precision=te_precision)
    assert isinstance(fabric._precision, TransformerEnginePrecision)
    losses, model = fabric_losses(fabric)
    assert_scaling_advanced(model)
    assert_tracks(losses, baseline, precision)


def assert_tracks(losses: torch.Tensor, baseline: torch.Tensor, precision: str) -> None:
    """The FP8 loss fell, and each step's loss and the progress since the first step are within
    E4M3's tolerance of the run at `precision`."""
    assert torch.isfinite(losses).all() and losses[-1] < losses[0] * 0.8, f"FP8 losses did not fall: {losses}"
    torch.testing.assert_close(losses, baseline, **E4M3, msg=lambda m: f"FP8 {losses} vs {precision} {baseline}: {m}")
    torch.testing.assert_close(losses[1:] - losses[0], baseline[1:] - baseline[0], **E4M3)


def trainer_losses(pl, precision: str):
    """The same training under PyTorch Lightning's Trainer: the losses and the trained model."""

    class Regression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model, self.losses = small_model(), []

        def training_step(self, batch, batch_idx):
            loss = nn.functional.mse_loss(self.model(batch[0]).float(), batch[1])
            self.losses.append(loss.detach())
            return loss

        def configure_optimizers(self):  # called after the plugin converted the model
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    module = Regression()
    trainer = pl.Trainer(accelerator="cpu", devices=1, precision=precision, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*problem()), batch_size=32, num_workers=0)
    with expected_warnings(), warnings.catch_warnings():  # and Lightning's own advice, about itself
        warnings.filterwarnings("ignore", message=".*does not have many workers", category=UserWarning)
        warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\)` is deprecated")
        trainer.fit(module, loader)
    return torch.stack(module.losses), module.model, trainer


def test_trainer_fp8_training_tracks_bf16(stand_in, fresh_availability):
    """PyTorch Lightning's Trainer(precision="transformer-engine") uses its TransformerEnginePrecision
    (Fabric's, extended) and trains like Trainer(precision="bf16-true")."""
    pl = pytest.importorskip("lightning.pytorch", reason="PyTorch Lightning's Trainer needs `pip install lightning`"
                                                         " (the lightning test extra installs Fabric only)")
    baseline, _, _ = trainer_losses(pl, "bf16-true")
    losses, model, trainer = trainer_losses(pl, "transformer-engine")
    assert isinstance(trainer.precision_plugin, pl.plugins.precision.TransformerEnginePrecision)
    assert [type(m) for m in model] == [te_core.Linear, te_core.LayerNorm, nn.GELU, te_core.Linear]
    assert_scaling_advanced(model)
    assert_tracks(losses, baseline, "bf16-true")


def test_uninstall_makes_the_plugin_unavailable_again(stand_in, fresh_availability, monkeypatch):
    TransformerEnginePrecision(weights_dtype=torch.float32)
    uninstall_transformer_engine()
    requirement = te_plugin._TRANSFORMER_ENGINE_AVAILABLE.requirement
    assert not RequirementCache(requirement)
    monkeypatch.setattr(te_plugin, "_TRANSFORMER_ENGINE_AVAILABLE", RequirementCache(requirement))
    with pytest.raises(ModuleNotFoundError, match="transformer_engine"):
        TransformerEnginePrecision(weights_dtype=torch.float32)
    with pytest.raises(ModuleNotFoundError, match="transformer_engine"):
        Fabric(accelerator="cpu", devices=1, precision="transformer-engine")
