"""Executors: how an engine runs a step on its model, one interface whether the model is in this process alone or
spread over ranks this process leads (rank 0 broadcasts the plan, then runs its own shard like every other rank).

`create_executor` picks one; the engine calls launch / collect / check_health / memory_stats / shutdown and never asks
which (execute: launch, then collect).
"""

from __future__ import annotations

import torch

from mini_infer.config import EngineConfig
from mini_infer.distributed.comm import Comm
from mini_infer.errors import WorkerDiedError
from mini_infer.executor.ranks import Ranks
from mini_infer.runner.model_runner import LaunchedStep, ModelRunner
from mini_infer.runner.plan import StepPlan
from mini_infer.runner.pooler import PoolerOutput
from mini_infer.runner.sampler import SamplerOutput


class LocalExecutor:
    """The whole model in this process: one rank."""

    def __init__(self, config: EngineConfig, num_blocks: int) -> None:
        self.runner = ModelRunner(config, num_blocks, Comm.local(config), torch.device(config.device))

    def execute(self, plan: StepPlan) -> SamplerOutput | PoolerOutput | None:
        return self.runner.execute(plan)

    def launch(self, plan: StepPlan) -> LaunchedStep | None:
        """Queue the step on the device (the host goes on while it runs)."""
        return self.runner.launch(plan)

    def collect(self, launched: LaunchedStep | None) -> SamplerOutput | PoolerOutput | None:
        return self.runner.collect(launched)

    def check_health(self) -> None:
        """Nothing can fail apart from this process."""

    def memory_stats(self) -> list[dict]:
        return [self.runner.memory_stats()]

    def shutdown(self) -> None:
        """Nothing to stop: the model goes with the engine."""


class RankExecutor:
    """Rank 0 of a tensor/pipeline-parallel world: it starts (or joins) the other ranks, broadcasts each step's plan
    and runs its own shard; a failed step stops every rank, and the executor refuses to step again."""

    def __init__(self, config: EngineConfig, num_blocks: int) -> None:
        self._failure: WorkerDiedError | None = None
        self.ranks = Ranks(config)
        try:
            self.runner = ModelRunner(config, num_blocks, self.ranks.comm, self.ranks.device)
            self.ranks.wait_ready()
        except BaseException:
            self.ranks.shutdown()
            raise

    def execute(self, plan: StepPlan) -> SamplerOutput | PoolerOutput | None:
        self._raise_if_failed()
        try:
            self.ranks.broadcast_step(plan)
            return self.ranks.guard(self.runner.execute, plan)
        except BaseException as e:  # the workers are stopped: this engine cannot step again
            self._failure = e if isinstance(e, WorkerDiedError) else WorkerDiedError(f"a step failed: {e!r}")
            raise

    def launch(self, plan: StepPlan) -> LaunchedStep:
        """The step run to its end (ranks step together: no step is scheduled ahead here)."""
        return LaunchedStep(self.execute(plan))

    def collect(self, launched: LaunchedStep) -> SamplerOutput | PoolerOutput | None:
        return launched.output

    def check_health(self) -> None:
        """Raise WorkerDiedError if a step failed or a worker rank has exited."""
        self._raise_if_failed()
        dead = self.ranks.dead_workers()
        if dead is not None:
            raise WorkerDiedError(f"{dead}; the engine cannot run another step")

    def memory_stats(self) -> list[dict]:
        return self.ranks.gather_stats(self.runner.memory_stats())

    def shutdown(self) -> None:
        self.ranks.shutdown()
        self._failure = self._failure or WorkerDiedError("the engine was shut down")

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise WorkerDiedError(f"the engine has stopped: {self._failure}")


Executor = LocalExecutor | RankExecutor


def create_executor(config: EngineConfig, num_blocks: int) -> Executor:
    """This process's model for one replica: in-process, or rank 0 of config.world_size ranks."""
    return RankExecutor(config, num_blocks) if config.world_size > 1 else LocalExecutor(config, num_blocks)
