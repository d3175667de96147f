"""transformers' own generic tests (ModelTesterMixin, GenerationTesterMixin, ConfigTester), for the installed version.

They are not in the transformers wheel. :func:`load_transformers_tests` finds them, in this order:

1. ``LINMEM_TRANSFORMERS_TESTS``: the ``tests`` folder of a transformers source tree at the installed version
   (``git clone --depth 1 --branch v<version> https://github.com/huggingface/transformers``): every generic test
   runs.
2. The cache, ``$XDG_CACHE_HOME/linmem/transformers-tests/<version>/tests`` (``~/.cache`` without
   ``XDG_CACHE_HOME``): the ``tests`` folder of the source distribution that
   ``pip download --no-binary :all: --no-deps transformers==<version>`` fetches from the package index, once per
   version (about 20 s; 11 MB downloaded, 1 MB kept). Where pip cannot fetch it (offline, a version the index does
   not have), the tests skip with pip's reason.

The source distribution holds ``tests/test_modeling_common.py`` and ``tests/test_configuration_common.py`` but not
the three modules they import from the source tree's sub-folders (so it is for 4.56, 5.17 and 5.24):
:data:`PARTS_OUTSIDE_THE_SDIST`. Each one that is missing is replaced by an empty stand-in, so that ModelTesterMixin
and ConfigTester import and run; what the missing module would have brought is reported by
:meth:`TransformersTests.skip_reason` (the generation tests, the export tests, ConfigTester's check of the common
keywords).
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import types
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest
import transformers

#: the package name the loaded test sources get (their own relative imports resolve inside it)
PACKAGE = "transformers_generic_tests"
ENVIRONMENT = "LINMEM_TRANSFORMERS_TESTS"
NEEDED = ("test_modeling_common.py", "test_configuration_common.py")
#: module of the source tree -> (the name imported from it, what its absence leaves untested)
PARTS_OUTSIDE_THE_SDIST = {
    "generation/test_utils.py": ("GenerationTesterMixin", "GenerationTesterMixin's generate() tests"),
    "exporters/test_export.py": ("ExportTesterMixin", "ExportTesterMixin's torch.export tests"),
    "utils/test_configuration_utils.py": ("config_common_kwargs",
                                          "ConfigTester's checks that the common PretrainedConfig keywords are kept"),
}


class SourcesUnavailable(RuntimeError):
    """transformers' generic tests cannot be had here (the message says why)."""


@dataclass
class TransformersTests:
    """The loaded test modules and where they came from."""

    modeling: types.ModuleType  # tests/test_modeling_common.py
    configuration: types.ModuleType  # tests/test_configuration_common.py
    generation_mixin: type  # GenerationTesterMixin, or its empty stand-in
    folder: Path
    missing: tuple[str, ...]  # the modules of PARTS_OUTSIDE_THE_SDIST replaced by stand-ins

    def skip_reason(self, part: str) -> Optional[str]:
        """Why the tests of ``part`` (a key of :data:`PARTS_OUTSIDE_THE_SDIST`) do not run, or None when they do."""
        return _missing_reason(part, self.folder) if part in self.missing else None


def _missing_reason(part: str, folder: Path) -> str:
    return (f"{PARTS_OUTSIDE_THE_SDIST[part][1]} do not run: transformers {transformers.__version__}'s tests in "
            f"{folder} lack tests/{part} (the source distribution does not ship it); set {ENVIRONMENT} to the tests "
            f"folder of a transformers source tree at v{transformers.__version__} to run them")


def load_transformers_tests() -> TransformersTests:
    """Import transformers' generic test modules for the installed version (see the module's docstring).

    Raises:
        SourcesUnavailable: the sources cannot be had, or a test dependency (``parameterized``) is missing.
    """
    try:
        import parameterized  # noqa: F401  (transformers' test modules import it)
    except ImportError as err:
        raise SourcesUnavailable("transformers' generic tests need `parameterized` (pip install parameterized, or "
                               "linmem's `test` extra)") from err
    folder = _tests_folder()
    missing = tuple(part for part in PARTS_OUTSIDE_THE_SDIST if not (folder / part).is_file())
    if PACKAGE not in sys.modules:
        _install_package(folder, missing)
    with warnings.catch_warnings():  # their marks (flash_attn_test, ...) are registered by their own conftest
        warnings.simplefilter("ignore", pytest.PytestUnknownMarkWarning)
        modeling = importlib.import_module(f"{PACKAGE}.test_modeling_common")
        configuration = importlib.import_module(f"{PACKAGE}.test_configuration_common")
    generation = importlib.import_module(f"{PACKAGE}.generation.test_utils")
    return TransformersTests(modeling, configuration, generation.GenerationTesterMixin, folder, missing)


def _tests_folder() -> Path:
    given = os.environ.get(ENVIRONMENT)
    if given:
        folder = Path(given)
        absent = [name for name in NEEDED if not (folder / name).is_file()]
        if absent:
            raise SourcesUnavailable(f"{ENVIRONMENT}={given} must be the tests folder of a transformers source tree; "
                                   f"it lacks {', '.join(absent)}")
        return folder
    version = transformers.__version__
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "linmem" / "transformers-tests"
    folder = cache / version / "tests"
    if not folder.is_dir():
        _download_tests(version, folder)
    return folder


def _download_tests(version: str, folder: Path) -> None:
    """Put the ``tests`` folder of transformers ``version``'s source distribution at ``folder`` (atomically)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as work:
        command = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "--quiet",
                   "--timeout", "30", "--retries", "1", "--dest", work, f"transformers=={version}"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired as err:
            raise SourcesUnavailable(f"`pip download transformers=={version}` took over 600 s") from err
        archives = list(Path(work).glob("transformers-*.tar.gz"))
        if done.returncode != 0 or not archives:
            reason = (done.stderr.strip().splitlines() or ["no source distribution"])[-1]
            raise SourcesUnavailable(f"cannot fetch transformers {version}'s source distribution with pip: {reason}")
        extracted = Path(work) / "tests"
        with tarfile.open(archives[0]) as archive:
            top = archive.getnames()[0].split("/")[0]
            for member in archive.getmembers():
                parts = Path(member.name).parts
                if member.isfile() and len(parts) > 2 and parts[:2] == (top, "tests"):
                    target = extracted.joinpath(*parts[2:])
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(archive.extractfile(member).read())
        if not all((extracted / name).is_file() for name in NEEDED):
            raise SourcesUnavailable(f"transformers {version}'s source distribution lacks tests/{NEEDED[0]}")
        (extracted / "__init__.py").touch()  # test_configuration_common imports the folder as a package
        shutil.move(extracted, folder)


def _install_package(folder: Path, missing: tuple[str, ...]) -> None:
    """Make ``folder`` the package :data:`PACKAGE`, with an empty stand-in for every module in ``missing``."""
    root = types.ModuleType(PACKAGE)
    root.__path__ = [str(folder)]
    sys.modules[PACKAGE] = root
    for part in missing:
        subfolder, module = part.removesuffix(".py").split("/")
        package_name = f"{PACKAGE}.{subfolder}"
        if package_name not in sys.modules:
            package = types.ModuleType(package_name)
            package.__path__ = [str(folder / subfolder)]
            sys.modules[package_name] = package
        stand_in = types.ModuleType(f"{package_name}.{module}", f"stand-in for the missing tests/{part}")
        name = PARTS_OUTSIDE_THE_SDIST[part][0]
        # a mixin whose one test reports the skip, or None for the keyword table (its check is skipped, not run
        # on an empty table)
        reason = _missing_reason(part, folder)
        setattr(stand_in, name, _skipping_mixin(name, reason) if name.endswith("Mixin") else None)
        sys.modules[stand_in.__name__] = stand_in


def _skipping_mixin(name: str, reason: str) -> type:
    """A stand-in for the mixin ``name`` whose only test skips with ``reason``."""

    def test_not_available(self) -> None:
        self.skipTest(reason)

    return type(name, (), {"__doc__": f"stand-in: {reason}", f"test_{name}_tests": test_not_available})
