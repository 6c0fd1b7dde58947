"""`lengthwise train --planner hydraulis` across processes: heterogeneous pipelines, each element's
optimizer state owned by one of the ranks holding it, strategy switches between steps
(hydraulis §5.2).

    lengthwise train --planner hydraulis --nproc 4 --pipelines tp2-pp1,tp1-pp2 --dtype float64

Two layouts per rank (`parallel/hetero.py` explains why):

- propagation: the rank's part of the plan's current strategy (its pipeline's stage, whole or
  as tp row / column shards), in the run's dtype, built by `parallel/build.build_rank_model`
  without FSDP2 (every pipeline may have another tp x pp x cp);
- optimisation: of every element it holds, the ones it owns (every h-th column of each band of
  columns its h holders share): the master weights (float32, float64 for a float64 run) and
  AdamW's two moments, flat, one `torch.optim.AdamW` over per-parameter views of the flat
  master shard, the moments views of two flat buffers laid out alike (weight decay on
  matrices only, as one process trains).

A step: the rank runs its actions with its own gradients left unsummed (`run_rank_step(...,
reduce_grads=False)`), pushes them to the owners (one all_to_all; the owner's sum, rank by rank,
is the sum over pipelines, TP replicas push zeros), takes the gradient norm over the owned
shards (each element counted once), clips, steps AdamW on its shard, and pulls its next
propagation weights (one all_to_all). Nothing is all-reduced; the masters never travel in a
step. The two all-to-alls carry what a reduce-scatter and an all-gather among each element's
holders carry.

Strategy switch. When a batch's plan has other pipelines than the previous one (Hydraulis picks
a strategy per batch, charging the switch: `planners/hydraulis/planner.py`; a test fixes them),
the rank builds its part of the new strategy on the meta device, materialises it without
initialising, builds the new exchange's blocks (cached per strategy), moves the masters and both
AdamW moments from their old owners to their new ones in one all_to_all
(`HeteroExchange.switch`; the optimizer object stays, its parameters become views of the moved
shard and keep their step counts) and pulls its weights from the new owners. Rank 0 logs each
switch on stderr with its measured cost (seconds, those of the move, bytes of optimizer state
moved and of weights pulled over all ranks), and the step's metrics line carries the same
record under "switch".

Checkpoints hold the owned shards (master, exp_avg, exp_avg_sq, step per parameter, keyed by
rank) as each rank's own safetensors pieces (`checkpoint_dist`, same manifest, RNG and sampler
extras) with the saved strategy's pipelines (`exchange_pipelines`), plus each rank's propagation
weights as `model.` pieces (its stage's, whole or TP shards), which `lengthwise export`
consolidates: nothing is gathered to one rank. (The exported weights are the propagation ones,
in the run's dtype: equal to the masters in a float64 run, the bfloat16 copy in a bfloat16 one.)
The held-out loss runs the held-out batch in the current strategy on every rank, gradients
dropped (`dist.RankExecutor.held_out_loss`).
A resumed run needs the same number of
processes (the layout depends on the ranks) but may use another strategy: it loads the shards
into the saved strategy's layout and moves them to its own owners as a switch does, then pulls
its propagation weights.
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from lengthwise.errors import UserError
from lengthwise.plan.ir import StepPlan
from lengthwise.planners.hydraulis.cost import pipelines_name
import lengthwise.runtime.distributed.checkpoint_dist as checkpoint_dist
from lengthwise.runtime.parallel.dp import check_same_plan
from lengthwise.runtime.parallel.step import run_rank_step
from lengthwise.runtime.model import parameter_names
from lengthwise.runtime.parallel.build import ParallelOptions, build_rank_model
from lengthwise.runtime.parallel.hetero import HeteroExchange
from lengthwise.runtime.parallel.hetero_reducer import HeteroReducer, plan_pipelines, strategy_holdings
from lengthwise.runtime.train.dist import OWNED_BY_HOLDERS, ROUND_ROBIN, RankExecutor
from lengthwise.runtime.train.executor import PreparedStep, StepOutcome
from lengthwise.runtime.train.loop import weights_folder
from lengthwise.runtime.train.step import PeakMemory


def strategy_key(plan: StepPlan) -> tuple:
    """What fixes every rank's propagation layout: each pipeline's tp, pp, cp and layers per stage."""
    return (plan.model, plan_pipelines(plan))


def strategy_name(plan: StepPlan) -> str:
    """tp2-pp1,tp1-pp2 (the pipelines option's grammar)."""
    return pipelines_name(plan.pipelines)


class HeteroRankExecutor(RankExecutor):
    """One rank of a Hydraulis run (the module docstring lists what a step does)."""

    def _build(self) -> None:
        config, plan = self.config, self.first_plan
        self.dtype = getattr(torch, config.dtype)
        self.master_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        self.switches: list[dict] = []
        self.optimizer = None
        folder = weights_folder(config.model)
        self._propagation(plan, seed=None if folder else config.seed, weights=folder)
        master = self.exchange.init_master_from_held(self.reducer.local_values(), dtype=self.master_dtype)
        self._adopt(master, torch.zeros_like(master), torch.zeros_like(master), steps=None)

    def _adopt(self, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
               steps: dict[str, torch.Tensor] | None) -> None:
        """Make `master` and the two moments (laid out like it, in the current exchange's layout)
        the optimizer's: one AdamW parameter per model parameter, a view of this rank's owned
        elements of it, its moments views of the flat moments; `steps`: each parameter's AdamW
        step count (None: 0). The optimizer object stays (the LR scheduler holds it)."""
        ex = self.exchange
        ex.master = self.master = master
        self.exp_avg, self.exp_avg_sq = exp_avg, exp_avg_sq
        self.views = {n: torch.nn.Parameter(ex.master_view(n)) for n in ex.shapes}
        matrices = [v for n, v in self.views.items() if len(ex.shapes[n]) >= 2]
        vectors = [v for n, v in self.views.items() if len(ex.shapes[n]) < 2]
        if self.optimizer is None:  # weight decay on matrices only, as one process trains
            self.optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": self.config.weight_decay},
                                                {"params": vectors, "weight_decay": 0.0}], lr=self.config.lr)
        else:
            for group, params in zip(self.optimizer.param_groups, (matrices, vectors)):
                group["params"] = params
            self.optimizer.state.clear()
        for n, view in self.views.items():  # the state AdamW's first step would create, so checkpoints can load into it
            self.optimizer.state[view] = {"step": torch.tensor(0.0) if steps is None else steps[n],
                                          "exp_avg": ex.master_view(n, exp_avg),
                                          "exp_avg_sq": ex.master_view(n, exp_avg_sq)}

    def _steps(self) -> dict[str, torch.Tensor]:
        return {n: self.optimizer.state[v]["step"] for n, v in self.views.items()}

    def _propagation(self, plan: StepPlan, *, seed: int | None, weights: str | None) -> None:
        """This rank's part of `plan`'s strategy and the exchange of that strategy (collective)."""
        odd = sorted({p.tp for p in plan.pipelines if plan.model.vocab % p.tp})
        if odd:
            raise UserError(f"--planner hydraulis across processes needs every tp to divide the vocabulary: "
                            f"{plan.model.name} has {plan.model.vocab} tokens, which tp "
                            f"{', '.join(map(str, odd))} does not divide")
        self.status.note(f"building its part of strategy {strategy_name(plan)}")
        self.model = build_rank_model(plan, self.mesh, dtype=self.dtype, seed=seed, weights=weights,
                                      options=ParallelOptions(data_parallel="replicate"))
        self.layout = self.mesh.layout(plan)
        self.held = dict(self.model.named_parameters())
        self.plan_now = plan
        self.reducer = HeteroReducer(self.model, plan, self.layout, key=strategy_key(plan))

    @property
    def exchange(self) -> HeteroExchange:
        return self.reducer.exchange

    # ---------------------------------------------------------------- a step
    def step(self, prepared: PreparedStep, step: int) -> StepOutcome:
        plan = prepared.plan
        check_same_plan(plan, self.mesh.device)
        self._check_unpadded(plan, step)
        switch = None
        if strategy_key(plan) != strategy_key(self.plan_now):
            switch = self._switch(plan, step)
        self.model.zero_grad(set_to_none=True)
        hook = functools.partial(self._after_action, plan, step)
        self.status.note(f"step {step}: starting the actions of {self.layout.place}")
        with PeakMemory(self.model) as peak:
            done = run_rank_step(self.model, plan, prepared.token_ids, mesh=self.mesh, backend=self.config.backend,
                                 check_plan=False, after_action=hook, reduce_grads=False)
        self.status.note(f"step {step}: gradient push, optimizer step on its owned shard, weight pull")
        grad = self.exchange.push(self.reducer.local_grads(), dtype=self.master_dtype)
        squares = grad.double().pow(2).sum().reshape(1).to(self.mesh.device)
        dist.all_reduce(squares)
        grad_norm = float(squares.sqrt().item())
        outcome = StepOutcome(loss=done.loss, grad_norm=grad_norm, peak_memory_bytes=self._largest(peak.bytes),
                              memory_kind=peak.kind, switch=switch)
        if not outcome.finite:  # the loss and the norm are global: every rank skips the update
            outcome.nonfinite_param = self._first_nonfinite_owned(grad)
            return outcome
        if self.config.grad_clip:  # clip_grads_with_norm_'s rule, the norm over all ranks
            coef = torch.clamp(self.config.grad_clip / (torch.tensor(grad_norm, dtype=torch.float64) + 1e-6), max=1.0)
            grad.mul_(coef.to(grad.dtype))
        ex = self.exchange
        for name, view in self.views.items():
            view.grad = ex.master_view(name, grad)
        self.optimizer.step()
        self.reducer.load_values(ex.pull(dtype=self.dtype))
        return outcome

    def _switch(self, plan: StepPlan, step: int) -> dict:
        """Rebuild this rank's propagation part for `plan`'s strategy, move the masters and AdamW
        moments to the new owners and pull its weights from them (collective). Returns the
        measured cost."""
        old = strategy_name(self.plan_now)
        started = time.perf_counter()
        previous, steps = self.exchange, self._steps()
        self._propagation(plan, seed=None, weights=None)  # materialised, not initialised: the pull fills it
        built = time.perf_counter() - started
        previous.master = self.master
        ex = previous.switch(strategy_key(plan), self.exchange.shapes, self.reducer.holdings,
                             state=(self.exp_avg, self.exp_avg_sq))
        assert ex is self.exchange
        self._adopt(ex.master, *ex.moved, steps=steps)
        self.reducer.load_values(ex.last_pull.to(self.dtype))
        seconds = time.perf_counter() - started
        cost = ex.switch_cost
        totals = torch.tensor([cost["pull_bytes"], cost["state_bytes_moved"], seconds, cost["move_s"]],
                              dtype=torch.float64, device=self.mesh.device)
        dist.all_reduce(totals[:2])
        dist.all_reduce(totals[2:], op=dist.ReduceOp.MAX)
        record = {"step": step, "from": old, "to": strategy_name(plan), "seconds": round(float(totals[2]), 6),
                  "build_s": round(built, 6), "move_s": round(float(totals[3]), 6),
                  "weight_bytes_pulled": int(totals[0]), "optimizer_state_bytes_moved": int(totals[1])}
        self.switches.append(record)
        if self.is_reporter:
            print(f"lengthwise train: step {step}: strategy {old} -> {record['to']} in {record['seconds']:.3f} s, "
                  f"{record['optimizer_state_bytes_moved']:,} bytes of optimizer state moved to the new owners "
                  f"({record['move_s']:.3f} s), {record['weight_bytes_pulled']:,} bytes of weights pulled",
                  file=sys.stderr)
        return record

    def _first_nonfinite_owned(self, grad: torch.Tensor) -> str | None:
        """The first parameter, in model order, with a NaN or infinity in any owner's shard of
        its summed gradient (collective)."""
        ex = self.exchange
        mine = [n for n in ex.shapes if not bool(torch.isfinite(ex.master_view(n, grad)).all())]
        every = [None] * self.mesh.world_size
        dist.all_gather_object(every, mine)
        bad = {name for names in every for name in names}
        return next((name for name in parameter_names(self.model.spec) if name in bad), None)

    # ---------------------------------------------------------------- weights and checkpoints
    def _held_out_options(self) -> dict:
        return {"pipelines": strategy_name(self.plan_now)}  # the held-out batch in the current strategy

    def _held_out_step_args(self) -> dict:
        return {"reduce_grads": False}  # dropped: not pushed to the owners

    def _check_held_out_layout(self, plan: StepPlan) -> None:
        if strategy_key(plan) != strategy_key(self.plan_now):
            raise UserError(f"the held-out batch was planned as strategy {strategy_name(plan)}, the run is at "
                            f"{strategy_name(self.plan_now)}; use fewer --eval-sequences")

    def _drop_grads(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def _dcp_state(self, ex: HeteroExchange, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                   steps: dict[str, torch.Tensor]) -> dict:
        """This rank's owned shards in `ex`'s layout, keyed by rank and parameter (each rank its
        own keys)."""
        rank, state = self.mesh.rank, {}
        for name in ex.shapes:
            state[f"rank{rank}.{name}.master"] = ex.master_view(name, master)
            state[f"rank{rank}.{name}.exp_avg"] = ex.master_view(name, exp_avg)
            state[f"rank{rank}.{name}.exp_avg_sq"] = ex.master_view(name, exp_avg_sq)
            state[f"rank{rank}.{name}.step"] = steps[name]
        return {"owned": state}

    def save(self, step: int, trainer: dict) -> Path:
        self.status.note(f"step {step}: saving its checkpoint")
        extras = {**trainer, "optimizer_layout": OWNED_BY_HOLDERS, "nproc": self.mesh.world_size,
                  "strategy": strategy_name(self.plan_now),
                  "exchange_pipelines": [[*p[:3], list(p[3])] for p in plan_pipelines(self.plan_now)]}
        state = self._dcp_state(self.exchange, self.master, self.exp_avg, self.exp_avg_sq, self._steps())
        state["model"] = {n: p.detach() for n, p in self.held.items()}  # for export: this rank's propagation pieces
        return checkpoint_dist.save_checkpoint(self.config.out, step=step, model=self.model, optimizer=self.optimizer,
                                               held=self.held, extras=extras, also=self._save_config, state=state,
                                               writes=self._writes())

    @property
    def plan_for_layout(self) -> StepPlan:
        return self.plan_now

    def load(self, path: Path) -> dict:
        """Restore the owned shards (same number of processes, any strategy: saved under another
        one, they load in the saved strategy's layout and move to this one's owners, as a switch
        moves them), pull this rank's propagation weights from them, restore the RNGs; returns
        the trainer state."""
        self.status.note(f"loading checkpoint {path}")
        state: dict = {}
        loading: dict = {}

        def check(extras: dict) -> None:  # before anything loads: the tensors to load into, in the saved layout
            self._check_layout(path, extras)
            saved = tuple((tp, pp, cp, tuple(layers)) for tp, pp, cp, layers in extras["exchange_pipelines"])
            model = self.plan_now.model
            holdings, dims = strategy_holdings(model, saved, list(self.exchange.shapes))
            ex = HeteroExchange.for_shape((model, saved), self.exchange.shapes, holdings, dims=dims,
                                          group=self.exchange.group, device=self.exchange.device)
            buffers = [torch.zeros(ex.shard_size, dtype=self.master_dtype, device=self.master.device) for _ in range(3)]
            steps = {n: torch.tensor(0.0) for n in ex.shapes}
            loading.update(exchange=ex, buffers=buffers, steps=steps)
            state.update(self._dcp_state(ex, *buffers, steps))

        extras = checkpoint_dist.load_checkpoint(path, model=self.model, optimizer=self.optimizer, held=self.held,
                                                 check=check, state=state,
                                                 allow_pickle=self.config.allow_pickle_checkpoint)
        saved, buffers = loading["exchange"], loading["buffers"]
        if saved is not self.exchange:
            send, recv = saved.layout.moves(self.exchange.layout, self.mesh.rank)
            buffers = self.exchange.move(buffers, send, recv)
        self._adopt(*buffers, steps=loading["steps"])
        self.reducer.load_values(self.exchange.pull(dtype=self.dtype))
        return extras

    def _check_layout(self, path: Path, extras: dict) -> None:
        layout = extras.get("optimizer_layout")
        if layout == ROUND_ROBIN:
            raise UserError(f"{path} holds its optimizer state round-robin over all ranks, the layout of an "
                            f"earlier lengthwise; this one owns each element among its holders and cannot "
                            f"resume it: restart from its model.safetensors (--model {path})")
        if layout != OWNED_BY_HOLDERS:
            raise UserError(f"{path} holds per-stage optimizer state (a run of --planner "
                            f"{extras.get('config', {}).get('planner')}); --planner hydraulis across processes "
                            f"resumes only its own checkpoints")
        if extras.get("nproc") != self.mesh.world_size:
            raise UserError(f"{path} deals its optimizer state over {extras.get('nproc')} processes, this run "
                            f"has {self.mesh.world_size}; resume with as many (any --pipelines of that size)")
