# shellcheck shell=bash
# megagrpo's Slurm job library, sourced by every sbatch script rendered from slurm/*.sbatch.
#
# The batch shell is the one process that receives the preemption signal (`#SBATCH --signal=B:USR1@N`,
# or `scancel --batch --signal=USR1 JOB`). It does not forward the signal to the job steps: a step-wide
# signal reaches every process of the step, SGLang's scheduler subprocesses included, and they die of it.
# Instead it creates a stop file on the shared log directory; every rank (megagrpo.launch.run) watches that
# file and raises SIGUSR1 in its own process only, so the trainer checkpoints at the next step boundary and
# exits with MEGAGRPO_REQUEUE_EXIT. The script maps that exit to `scontrol requeue`, and the requeued job
# resumes with `--resume auto`.

# = megagrpo.trainer.signals.REQUEUE_EXIT_CODE (a unit test keeps the two equal)
MEGAGRPO_REQUEUE_EXIT=75

megagrpo_log() {
    echo "[megagrpo-slurm $(date +%H:%M:%S)] $*"
}

# The address other nodes reach a node at: its NodeAddr in slurm.conf (defaults to the node name there),
# which is the address Slurm itself uses. MEGAGRPO_MASTER_ADDR overrides it (e.g. a fabric IP).
megagrpo_node_addr() {
    local node=$1 addr
    addr=$(scontrol show node "$node" -o 2>/dev/null | tr ' ' '\n' | sed -n 's/^NodeAddr=//p')
    echo "${addr:-$node}"
}

# Everything a rank needs before the launcher starts: python, the rendezvous address and port, the
# collective-library variables, the stop file and the requeue marker. Arguments: DEVICE (gpu|cpu).
megagrpo_setup() {
    local device=$1
    export PYTHONUNBUFFERED=1
    if [ -n "${MEGAGRPO_VENV:-}" ] && [ -d "$MEGAGRPO_VENV/bin" ]; then
        export VIRTUAL_ENV=$MEGAGRPO_VENV
        export PATH="$MEGAGRPO_VENV/bin:$PATH"
    fi
    MEGAGRPO_MASTER_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    export MASTER_ADDR=${MEGAGRPO_MASTER_ADDR:-$(megagrpo_node_addr "$MEGAGRPO_MASTER_HOST")}
    # One port per job (requeues keep the job id, and so the port); 20000-39999 avoids ephemeral ports.
    export MASTER_PORT=${MEGAGRPO_MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
    if [ "$device" = cpu ]; then
        # CPU mode: "GPUs per node" counts processes; hide any GPU so torch picks gloo.
        export CUDA_VISIBLE_DEVICES=""
        export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${MEGAGRPO_CPUS_PER_PROC:-1}}
    else
        export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
        export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
        export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
        # SGLang's Engine sets these two (only where unset) in the process that creates it, i.e. on the
        # engine-owning ranks only; every rank must build its NCCL communicators with the same settings.
        # Same values as megagrpo.learner.mesh.NCCL_DEFAULTS, which sets them for non-Slurm launches.
        export NCCL_CUMEM_ENABLE=${NCCL_CUMEM_ENABLE:-0}
        export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
        export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
    fi
    export MEGAGRPO_STOP_FILE="$MEGAGRPO_LOG_DIR/$SLURM_JOB_NAME-$SLURM_JOB_ID.stop"
    export MEGAGRPO_REQUEUE_MARKER="$MEGAGRPO_LOG_DIR/$SLURM_JOB_NAME-$SLURM_JOB_ID.requeue"
    rm -f "$MEGAGRPO_STOP_FILE" "$MEGAGRPO_REQUEUE_MARKER"  # left over from the run before a requeue
    megagrpo_log "job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0}: nodes $SLURM_JOB_NODELIST," \
        "MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT device=$device"
}

megagrpo_request_stop() {
    megagrpo_log "got SIG$1: asking every rank to checkpoint at the next step boundary"
    touch "$MEGAGRPO_STOP_FILE"
}

# Run the launcher ("$@") in the background so that the shell's traps run while it works; then map the
# trainer's requeue exit to `scontrol requeue`. Returns the launcher's exit code otherwise.
megagrpo_launch() {
    "$@" &
    local pid=$! rc
    trap 'megagrpo_request_stop USR1' USR1
    trap 'megagrpo_request_stop TERM' TERM
    while :; do
        wait "$pid"
        rc=$?
        kill -0 "$pid" 2>/dev/null || break  # still running: `wait` was interrupted by a trap
    done
    trap - USR1 TERM
    if [ "$rc" -eq "$MEGAGRPO_REQUEUE_EXIT" ] || [ -e "$MEGAGRPO_REQUEUE_MARKER" ]; then
        megagrpo_log "the trainer saved a checkpoint and asked for a requeue (exit $rc): scontrol requeue"
        rm -f "$MEGAGRPO_STOP_FILE" "$MEGAGRPO_REQUEUE_MARKER"
        if scontrol requeue "$SLURM_JOB_ID"; then
            sleep 60  # Slurm ends this run of the script now
            return 0
        fi
        megagrpo_log "scontrol requeue failed (was the job submitted with --no-requeue?); the checkpoint" \
            "is saved: resubmit the same script and it resumes (--resume auto)"
        return "$rc"
    fi
    megagrpo_log "launcher exited with $rc"
    return "$rc"
}
