"""`megagrpo submit`: render an sbatch script from slurm/ for a config, check it against the cluster, submit.

`render` fills the templates in `slurm/` (which import nothing from megagrpo: they are shell with `{{name}}`
fields); `resources` checks the config's mesh against nodes x GPUs per node and the partition's sizes;
`slurm` wraps the client commands (sinfo, sbatch); `command` is the CLI subcommand joining them.
"""

from megagrpo.submit.render import LAYOUTS, TEMPLATE_DIR, render, render_layout
from megagrpo.submit.resources import JobShape, check_mesh_fits, check_partition_fits
from megagrpo.submit.slurm import PartitionInfo, partitions, sbatch

__all__ = [
    "LAYOUTS",
    "TEMPLATE_DIR",
    "JobShape",
    "PartitionInfo",
    "check_mesh_fits",
    "check_partition_fits",
    "partitions",
    "render",
    "render_layout",
    "sbatch",
]
