"""Building Transformer Engine's torch binding (`transformer_engine_torch`) against the target's torch.

PyPI has no wheel of it: its setup downloads a release binary, which an offline node cannot, and the
binding must match the node's torch C++ ABI anyway. It is a C++ extension (2.12.0: 28 `.cpp` files, no
`.cu`), so it needs g++, the target torch's headers, CUDA's and cuDNN's and NCCL's headers, but no nvcc
and no GPU: it builds on this CPU machine.

Everything comes from PyPI wheels, in a build folder of its own:
- a venv with the target torch (`torch==2.11.0` pulls its CUDA wheels: `nvidia/cu13/include` holds the
  runtime, cuBLAS, cuSPARSE and nvrtc headers; `nvidia/{cudnn,nccl}/include` the rest);
- CUDA's `crt/` and CCCL headers (`nvidia-cuda-crt`, `nvidia-cuda-cccl`), which the runtime headers
  include and torch does not pull;
- a CUDA_HOME whose `include` is the wheel's, and whose `bin/nvcc` only prints the CUDA version: TE's
  setup asks nvcc for the version and compiles nothing with it.

Cost: about 29 minutes on 2 cores (the longest file over 3 minutes), a few minutes on 16; the venv is 4.6
GB, mostly torch's CUDA libraries, downloaded once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

from megagrpo.errors import MegagrpoError

_FAKE_NVCC = '#!/bin/sh\n# megagrpo.bundle.binding: TE setup asks nvcc for the CUDA version only\necho "Cuda compilation tools, release {v}, V{v}"\n'


def _run(cmd: list[str], what: str, **kw) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        raise MegagrpoError(
            f"{what} failed (exit {proc.returncode}): {' '.join(cmd[:6])} ...\n{proc.stderr[-3000:]}"
        )


def build_te_binding(
    te_version: str, torch_version: str, cuda: str, work: Path, out: Path, jobs: int = 2
) -> Path:
    """Build `transformer_engine_torch==te_version` against `torch==torch_version` (CUDA `cuda`, e.g. "13.0")
    in `work`, and return the wheel written to `out`."""
    work, out = Path(work).resolve(), Path(out).resolve()
    venv, extra, cuda_home = work / "venv", work / "headers", work / "cuda"
    py = venv / "bin" / "python"
    if not py.exists():
        _run([sys.executable, "-m", "venv", str(venv)], "creating the build venv")
    _run([str(py), "-m", "pip", "install", "-q", f"torch=={torch_version}", "numpy", "setuptools", "wheel",
          "pybind11", "ninja", "packaging", "pydantic"], f"installing torch {torch_version} into the build venv")  # fmt: skip
    site = Path(subprocess.check_output([str(py), "-c", "import sysconfig;print(sysconfig.get_paths()['purelib'])"], text=True).strip())  # fmt: skip
    major = cuda.split(".")[0]
    nv = site / "nvidia"
    cu = nv / f"cu{major}" / "include"
    if not (cu / "cuda_runtime_api.h").is_file():
        raise MegagrpoError(
            f"torch {torch_version} did not bring CUDA {major} headers ({cu}): is it a CUDA build?"
        )
    for pkg in ("nvidia-cuda-crt", "nvidia-cuda-cccl"):
        dest = extra / pkg
        if not dest.is_dir():
            _run([str(py), "-m", "pip", "download", "-q", "--no-deps", "-d", str(extra), f"{pkg}=={cuda}.*"], f"downloading {pkg}")  # fmt: skip
            wheel = next(extra.glob(pkg.replace("-", "_") + "-*.whl"))
            zipfile.ZipFile(wheel).extractall(dest)
    (cuda_home / "bin").mkdir(parents=True, exist_ok=True)
    nvcc = cuda_home / "bin" / "nvcc"
    nvcc.write_text(_FAKE_NVCC.format(v=cuda))
    nvcc.chmod(0o755)
    if not (cuda_home / "include").exists():
        (cuda_home / "include").symlink_to(cu)
    src = work / "src"
    if not list(src.glob("transformer_engine_torch-*.tar.gz")):
        _run([str(py), "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "--no-build-isolation",
              "-d", str(src), f"transformer_engine_torch=={te_version}"], "downloading the TE torch sdist")  # fmt: skip
    includes = [extra / "nvidia-cuda-cccl" / "nvidia" / f"cu{major}" / "include",
                extra / "nvidia-cuda-crt" / "nvidia" / f"cu{major}" / "include",
                nv / "nccl" / "include", nv / "cudnn" / "include", cu]  # fmt: skip
    env = dict(os.environ, CUDA_HOME=str(cuda_home), CUDA_PATH=str(cuda_home), NVTE_FRAMEWORK="pytorch",
               NVTE_PYTORCH_FORCE_BUILD="TRUE", MAX_JOBS=str(jobs), CPATH=os.pathsep.join(map(str, includes)),
               PATH=f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")  # fmt: skip
    sdist = next(src.glob("transformer_engine_torch-*.tar.gz"))
    out.mkdir(parents=True, exist_ok=True)
    _run([str(py), "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", str(sdist), "-w", str(out)],
         f"building transformer_engine_torch {te_version}", env=env)  # fmt: skip
    wheels = sorted(out.glob(f"transformer_engine_torch-{te_version}*.whl"))
    if not wheels:
        raise MegagrpoError(f"the TE binding build wrote no wheel into {out}")
    return wheels[-1]
