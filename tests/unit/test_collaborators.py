"""Collaborators that talk in values (issue 45): how often one of the Job's collaborators in
loop/ reaches through the Job into another (``job.steps.last_rate()``,
``self.job.membership.elastic``), and whether any calls the Job's private methods. Reads the
code.

A reach-through is invisible to the imports and to a reader of the signatures; what a
collaborator needs it takes as a typed parameter instead (the Recorder, the policy engine,
``fail``), and what it does it returns. Today's debt is recorded per edge in ``REACH``: the
test fails when an edge is new or grows, and when one shrank (then lower it here), so the
table only shrinks. Measured before the first repayment (2026-12-07): 82 reach-throughs
along 29 edges, 9 two-way pairs, 3 calls into ``Job._require_setup``."""

import ast
import collections
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOOP = os.path.join(ROOT, "hpcadapt", "loop")

# The Job's attribute for each collaborator, and the module that defines it.
COLLABORATORS = {
    "steps": "steps.py", "recorder": "recording.py", "failures": "failures.py",
    "monitoring": "monitoring.py", "adaptation": "adaptation.py", "stops": "stops.py",
    "resizing": "resizing.py", "rounds": "rounds.py",
}

# (from, into) -> reach-throughs still allowed: none since 2026-12-07 (the Recorder, the
# policy engine, the monitoring, the stop signals, the membership's protocols and the
# training state became parameters; the step runner's last step a ``StepReport`` the Job
# hands over; the summary and the end's order the Job's).
REACH: dict = {}


def _is_job(node) -> bool:
    """``parts`` or ``self.parts`` (``job``, ``self.job`` before): the Job's parts, as a
    collaborator holds them (``loop.parts.JobParts``)."""
    if isinstance(node, ast.Name):
        return node.id in ("job", "parts")
    return (isinstance(node, ast.Attribute) and node.attr in ("job", "parts")
            and isinstance(node.value, ast.Name) and node.value.id == "self")


def _modules():
    for name in sorted(os.listdir(LOOP)):
        if name.endswith(".py"):
            path = os.path.join(LOOP, name)
            yield name, ast.parse(open(path, encoding="utf-8").read())


def reach_throughs():
    """(from, into) -> [(module, line, 'into.attribute')] for every ``job.<into>.<attr>``
    in a module of loop/ other than <into>'s own."""
    owner = {module: attr for attr, module in COLLABORATORS.items()}
    found = collections.defaultdict(list)
    for name, tree in _modules():
        me = owner.get(name, name)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                    and _is_job(node.value.value) and node.value.attr in COLLABORATORS
                    and node.value.attr != me):
                found[(me, node.value.attr)].append(
                    (name, node.lineno, f"{node.value.attr}.{node.attr}"))
    return found


def private_calls():
    """``job._something`` read in loop/: the Job's private parts."""
    return [(name, node.lineno, node.attr) for name, tree in _modules()
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and _is_job(node.value)
            and node.attr.startswith("_")]


def test_the_table_names_the_job_s_collaborators():
    """Each name is an attribute the Job assigns, and each module exists."""
    tree = ast.parse(open(os.path.join(ROOT, "hpcadapt", "job.py"), encoding="utf-8").read())
    assigned = {t.attr for n in ast.walk(tree) if isinstance(n, ast.Assign)
                for t in n.targets if isinstance(t, ast.Attribute)}
    assert set(COLLABORATORS) - {"rounds"} <= assigned
    for module in COLLABORATORS.values():
        assert os.path.exists(os.path.join(LOOP, module)), module


def test_no_collaborator_reaches_through_the_job_more_than_recorded():
    found = reach_throughs()
    counts = {edge: len(where) for edge, where in found.items()}
    grown = {f"{a} -> {b}": [f"{m}:{line} {what}" for m, line, what in found[(a, b)]]
             for (a, b), n in counts.items() if n > REACH.get((a, b), 0)}
    assert not grown, ("reach-throughs from one collaborator into another (take what is "
                       f"needed as a parameter, or return it): {grown}")
    shrunk = {f"{a} -> {b}": (n, counts.get((a, b), 0)) for (a, b), n in REACH.items()
              if counts.get((a, b), 0) < n}
    assert not shrunk, f"repaid (lower REACH: recorded, now): {shrunk}"


def test_two_way_pairs_only_shrink():
    edges = set(reach_throughs())
    pairs = {tuple(sorted(e)) for e in edges if (e[1], e[0]) in edges}
    recorded = {tuple(sorted(e)) for e in REACH if (e[1], e[0]) in REACH}
    assert pairs <= recorded, f"new two-way pairs: {sorted(pairs - recorded)}"
    assert not pairs


def test_no_collaborator_calls_the_job_s_private_methods():
    assert private_calls() == []


def _training_state_fields():
    """The attributes TrainingState and HyperParams hold."""
    tree = ast.parse(open(os.path.join(ROOT, "hpcadapt", "state", "training.py"),
                          encoding="utf-8").read())
    fields = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in ("TrainingState", "HyperParams"):
            for sub in ast.walk(node):
                if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) \
                        and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                    fields.add(sub.attr)
                if isinstance(sub, ast.AnnAssign) and isinstance(sub.target, ast.Name):
                    fields.add(sub.target.id)   # a dataclass field
    return fields


def _names_the_state(node) -> bool:
    """``st``, ``h``, ``hyper``, ``<x>.state`` or ``<x>.state.hyper``: how the code names the
    training state and its hyper-parameters."""
    if isinstance(node, ast.Name):
        return node.id in ("st", "state", "h", "hyper")
    return isinstance(node, ast.Attribute) and node.attr in ("state", "hyper") \
        and not (isinstance(node.value, ast.Name) and node.value.id == "self"
                 and node.attr == "hyper")


def test_the_training_state_is_written_only_inside_hpcadapt_state():
    """Every change of the training state goes through its own methods (``commit``,
    ``next_epoch``, ``set_hyper``, ``switch_strategy`` ...): no module outside
    hpcadapt/state/ assigns its attributes."""
    fields = _training_state_fields()
    assert {"step", "hyper", "strategy", "topology", "lr", "ramp"} <= fields
    # the epoch has one owner, the sampler: the state reads it (no setter to call)
    from hpcadapt.state.training import TrainingState

    assert isinstance(TrainingState.epoch, property) and TrainingState.epoch.fset is None
    found = []
    base = os.path.join(ROOT, "hpcadapt")
    for folder, _, files in os.walk(base):
        if os.path.relpath(folder, base).split(os.sep)[0] == "state":
            continue
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            tree = ast.parse(open(path, encoding="utf-8").read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                        and node.attr in fields and _names_the_state(node.value):
                    found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.attr}")
    assert not found, f"the training state written from outside its methods: {found}"


def test_each_collaborator_takes_the_job_s_parts_typed_and_reads_nothing_else_of_it():
    """Every collaborator's first parameter is ``parts: JobParts``, and through it reads only
    the parts the protocol names (the options, the world, the state, the user's model,
    optimizer, loader and extra state): never another collaborator, a Job method or a
    flag. What else it needs it is handed on its own."""
    from hpcadapt.loop.parts import PART_NAMES, JobParts

    assert set(PART_NAMES) == set(JobParts.__annotations__)
    read = collections.defaultdict(set)
    typed = {}
    for name, tree in _modules():
        if name not in COLLABORATORS.values():
            continue  # progress.py's ProgressLR is the user's, given the Job itself
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _is_job(node.value):
                read[name].add(node.attr)
            if isinstance(node, ast.FunctionDef) and node.name == "__init__":
                first = node.args.args[1] if len(node.args.args) > 1 else None
                if first is not None and first.arg in ("job", "parts"):
                    typed[name] = ast.unparse(first.annotation) if first.annotation else None
    beyond = {name: sorted(attrs - set(PART_NAMES)) for name, attrs in read.items()
              if attrs - set(PART_NAMES)}
    assert beyond == {}, f"read through the Job's parts beyond JobParts: {beyond}"
    assert set(typed) >= set(COLLABORATORS.values()) - {"recording.py"}, typed
    assert set(typed.values()) == {"JobParts"}, typed
