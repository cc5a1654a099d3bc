"""Package metadata for the transformer_engine stand-in.

Integrations ask for Transformer Engine's distribution before they import it (Hugging Face
Accelerate's is_transformer_engine_available reads `importlib.metadata.metadata("transformer-engine")`),
so while the stand-in is installed a metadata finder answers for that name, in this process only:
version `<TE API level>+tecore.<te-core version>`, as `transformer_engine.__version__`. Nothing is
written to disk, and a real distribution, if one is installed, is never answered for.
"""
from __future__ import annotations

import importlib.metadata as metadata
import re
import sys
from pathlib import Path
from typing import Iterator, Optional

DISTRIBUTION = "transformer-engine"


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class StandInDistribution(metadata.Distribution):
    """The METADATA of the stand-in: name, version and a summary; no files, no entry points."""

    def __init__(self, version: str):
        self._metadata = (f"Metadata-Version: 2.1\nName: {DISTRIBUTION}\nVersion: {version}\n"
                          "Summary: te-core standing in for Transformer Engine\n")

    def read_text(self, filename: str) -> Optional[str]:
        return self._metadata if filename in ("METADATA", "PKG-INFO") else None

    def locate_file(self, path) -> Path:
        raise FileNotFoundError(f"the transformer_engine stand-in has no files on disk (asked for {path})")


class StandInFinder(metadata.DistributionFinder):
    """On sys.meta_path while the stand-in is installed; finds no modules, only the distribution."""

    def __init__(self, version: str):
        self.distribution = StandInDistribution(version)

    def find_spec(self, fullname, path=None, target=None):
        return None  # the stand-in's modules are in sys.modules already

    def find_distributions(self, context=metadata.DistributionFinder.Context()) -> Iterator[metadata.Distribution]:
        if context.name is not None and _normalized(context.name) == DISTRIBUTION:
            yield self.distribution


def install_metadata(version: str) -> None:
    """Answer for the transformer-engine distribution (once, however often it is called)."""
    if not any(isinstance(f, StandInFinder) for f in sys.meta_path):
        sys.meta_path.append(StandInFinder(version))


def uninstall_metadata() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, StandInFinder)]
