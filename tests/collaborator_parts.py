"""The Job's parts and its collaborators assembled as ``Job.setup`` assembles them, without a
Job: a plain object of the parts (``loop.parts.JobParts``) holding a real world of ``comm``
(``MPI.COMM_SELF`` for one rank with no launcher; the launch's ranks otherwise), a real
``DistributedOptimizer`` around the user's SGD, a real loader and ``TrainingState``, a real
``Recorder``; the other collaborators as the callables each is handed. For the tests that
run the loop's collaborators alone (issue 45)."""

import copy
import json
from types import SimpleNamespace

import torch
from mpi4py import MPI
from torch.utils.data import TensorDataset

from hpcadapt.adapt.control import ControlLayout
from hpcadapt.adapt.monitors import GradientNoiseScale
from hpcadapt.base import strategies
from hpcadapt.base.options import JobOptions
from hpcadapt.comm.world import World
from hpcadapt.data.loader import ElasticDataLoader
from hpcadapt.loop.adaptation import Adaptation
from hpcadapt.loop.monitoring import Monitoring
from hpcadapt.loop.recording import Recorder
from hpcadapt.loop.steps import StepRunner
from hpcadapt.parallel.optimizer import DistributedOptimizer
from hpcadapt.state.training import HyperParams, TrainingState, UserState

BATCH = 16


class Assembly:
    """The parts and the collaborators a test builds, as the Job would (``Job.setup``)."""

    def __init__(self, tmp_path, strategy="ssgd", comm=MPI.COMM_SELF, samples=64, **options):
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 3)
        self.sgd = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.start = copy.deepcopy(self.model)   # the weights before any step
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(samples, 4, generator=g),
                             torch.randint(0, 3, (samples,), generator=g))
        loader = ElasticDataLoader(data, BATCH, seed=0)
        world = World(comm.Dup())
        o = JobOptions.of(strategy=strategy, **options)
        optimizer = DistributedOptimizer(self.sgd, self.model.named_parameters(), world=world,
                                         extra_slots=ControlLayout(world.size).length)
        self.parts = SimpleNamespace(options=o, world=world, state=None, model=self.model,
                                     optimizer=optimizer, loader=loader, extra=UserState())
        self.metrics = tmp_path / "m.jsonl"
        self.recorder = Recorder()   # rank 0 writes the metrics file, as the Job's
        self.recorder.open(str(self.metrics), enabled=world.rank == 0, resuming=False)
        self.resize_requests = []
        self.adaptation = Adaptation(self.parts, self.recorder, snapshot=lambda: None,
                                     check_replicas=lambda: None,
                                     request_resize=lambda *a, **kw:
                                     self.resize_requests.append((a, kw)))
        self.monitoring = Monitoring(self.parts, self.recorder, self.adaptation.engine)
        self.monitoring.configure()
        hyper = HyperParams(batch_size=BATCH, lr=0.1, momentum=0.9, base_lr=0.1,
                            base_batch_size=BATCH)
        state = TrainingState(self.model, self.sgd, loader.sampler, hyper,
                              GradientNoiseScale(o.monitoring.monitor_ema,
                                                 self.monitoring.config.window),
                              self.parts.extra, self.adaptation.engine)
        state.switch_strategy(strategies.from_options(o.steps))
        state.switch_topology(o.comm.topology)
        self.parts.state = state
        optimizer.follow(state, o.comm.ranks_per_node)
        loader.bind(lambda: iter(()), state.global_batch_size)
        loader.sampler.job_driven = True

    def runner(self, signals=None, recoverable=True):
        return StepRunner(self.parts, self.recorder, self.adaptation.engine, signals,
                          self.monitoring, follow_ramp=self.adaptation.follow_ramp,
                          recoverable=lambda: recoverable,
                          slot_ranks=lambda: self.parts.world.size,
                          restart_pending=lambda: False)

    def records(self, event):
        """The metrics file's lines of ``event`` (none while nothing was written)."""
        if not self.metrics.exists():
            return []
        return [r for r in map(json.loads, self.metrics.read_text().splitlines())
                if r.get("event") == event]


def loss_of(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)
