"""Fill the sbatch templates in `slurm/`: `{{name}}` fields, every one required (but `OPTIONAL`'s), none
left behind.

The templates are plain bash with `{{name}}` fields (so that bash's own `${VAR}` stays untouched);
`{{lib_sh}}` is replaced by slurm/lib.sh itself, so a rendered script is self-contained: a requeue days
later runs exactly what was submitted, whatever happened to the checkout since.

The repository's `slurm/` is the one copy of the templates. The package reaches it as its resource
`megagrpo/submit/slurm`, a symbolic link to `../../slurm` that the wheel build replaces by the files
(package data in pyproject.toml), so an installed megagrpo renders without a checkout.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from importlib.resources import files

from megagrpo.errors import MegagrpoError

TEMPLATE_DIR = files("megagrpo.submit") / "slurm"
LAYOUTS = {
    "single": "single_node.sbatch",  # one node, one srun task running torchrun --standalone
    "torchrun": "multi_node_torchrun.sbatch",  # one srun task per node, each running torchrun
    "srun": "multi_node_srun.sbatch",  # one srun task per rank, no torchrun
}
LIB = "lib.sh"
# Fields a caller may leave out, with their value then: `roles` is a comment naming which ranks learn and
# which serve rollouts (`megagrpo submit` always fills it).
OPTIONAL = {"roles": ""}
_FIELD = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


def render(template: str, values: Mapping[str, str]) -> str:
    """Replace every `{{name}}` in `template` with `values[name]`; a field without a value is an error."""
    missing = sorted({m.group(1) for m in _FIELD.finditer(template)} - set(values))
    if missing:
        raise ValueError(f"template fields without a value: {', '.join(missing)}")
    return _FIELD.sub(lambda m: str(values[m.group(1)]), template)


def template_text(layout: str) -> str:
    if layout not in LAYOUTS:
        raise MegagrpoError(f"--layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    path = TEMPLATE_DIR / LAYOUTS[layout]
    if not path.is_file():
        raise MegagrpoError(
            f"{path}: sbatch template missing; reinstall megagrpo (the wheel ships slurm/ as package data)"
        )
    return path.read_text()


def render_layout(layout: str, values: Mapping[str, str]) -> str:
    """The sbatch script for `layout` ('single', 'torchrun' or 'srun') with slurm/lib.sh inlined."""
    lib = (TEMPLATE_DIR / LIB).read_text().rstrip("\n")
    # Blank template lines left by empty optional fields (no --partition, no --time) are dropped.
    script = render(template_text(layout), {**OPTIONAL, **values, "lib_sh": lib})
    return re.sub(r"\n{3,}", "\n\n", script)
