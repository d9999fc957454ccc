"""One owner per value (issue 32): which of the Job's attributes are written from more than
one module of job.py and loop/ (a mixin per file, all writing ``self``). Reads the code.

Today's debt is recorded in ``SHARED``: the test fails when a new attribute gets a second
writer, and when a recorded one has lost it (then strike it from the list), so the list
only shrinks as the Job becomes collaborators that own their state."""

import ast
import collections
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Measured 2026-11-27: 41 attributes of the Job written from more than one file (most are
# set in Job.__init__ and written again by one mixin; _in_flight, _step_open and _prev_grads
# by four files). Repaid since: sink, _epoch_logged, _epoch_samples (loop/recording.py),
# _prev_grads, _prev_count (now adapt/monitors.SplitStep); the step in flight, its
# timings, control values and micro-batch counters, 23 of them (loop/steps.StepRunner,
# loop/rounds.BoundedDelayRounds); _restart and joining, once the recovery became a
# collaborator that returns what it did (loop/failures.Failures); _queued_hooks and
# finished_by_stop_file, once the boundary's loop control moved into job.py and the
# policies' plans into loop/adaptation.Adaptation; stopped, _requeue, exit_code and
# _resumed_at, owned by loop/stops.Stops now; _holds_state, _identical_after_resize,
# allocator, elastic and left, owned by loop/resizing.Resizing (the last mixin).
SHARED: set = set()

# The Job's collaborators in loop/: each owns the attributes its class assigns on ``self``;
# no other module may assign them (``job.steps.open = False`` from a recovery, say).
COLLABORATORS = {
    "hpcadapt/loop/steps.py": "StepRunner",
    "hpcadapt/loop/rounds.py": "BoundedDelayRounds",
    "hpcadapt/loop/recording.py": "Recorder",
    "hpcadapt/loop/failures.py": "Failures",
    "hpcadapt/loop/monitoring.py": "Monitoring",
    "hpcadapt/loop/adaptation.py": "Adaptation",
    "hpcadapt/loop/stops.py": "Stops",
    "hpcadapt/loop/resizing.py": "Resizing",
}


def _job_files():
    yield os.path.join(ROOT, "hpcadapt", "job.py")
    loop = os.path.join(ROOT, "hpcadapt", "loop")
    for name in sorted(os.listdir(loop)):
        if name.endswith(".py"):
            yield os.path.join(loop, name)


def _assigned_attributes(tree):
    """Every ``<expression>.<attribute>`` a module assigns (plain, augmented, annotated or
    unpacked assignments)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
                    yield sub


def _on_self(attribute):
    return isinstance(attribute.value, ast.Name) and attribute.value.id == "self"


def self_writes(tree):
    """The attributes of ``self`` a module assigns."""
    return (a.attr for a in _assigned_attributes(tree) if _on_self(a))


def _job_classes():
    """The Job and the mixins it is made of (its bases in job.py): collaborators in loop/
    own their attributes and are not counted."""
    tree = ast.parse(open(os.path.join(ROOT, "hpcadapt", "job.py"), encoding="utf-8").read())
    job = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Job")
    return {"Job"} | {b.id for b in job.bases if isinstance(b, ast.Name)}


def writers_of_self_attributes():
    """attribute -> the files whose Job or mixin class assigns ``self.<attribute>``."""
    classes = _job_classes()
    writers = collections.defaultdict(set)
    for path in _job_files():
        tree = ast.parse(open(path, encoding="utf-8").read())
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name in classes:
                for attr in self_writes(node):
                    writers[attr].add(os.path.relpath(path, ROOT))
    return writers


def test_every_part_of_the_job_is_read():
    """Each base of the Job is a class of job.py or loop/ (else its writes go uncounted)."""
    defined = set()
    for path in _job_files():
        tree = ast.parse(open(path, encoding="utf-8").read())
        defined |= {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    assert _job_classes() <= defined, _job_classes() - defined


def test_no_new_attribute_gets_a_second_writer_and_the_debt_only_shrinks():
    writers = writers_of_self_attributes()
    shared = {a for a, files in writers.items() if len(files) > 1}
    new = {a: sorted(writers[a]) for a in shared - SHARED}
    assert not new, f"written from more than one module (give each value one owner): {new}"
    repaid = sorted(SHARED - shared)
    assert not repaid, f"one writer now (strike them from SHARED): {repaid}"


def _class_named(tree, name):
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def foreign_writes(tree, owned):
    """(line, attribute) of each assignment to ``<something>.<a>.<attribute>`` or
    ``<name>.<attribute>`` other than ``self.<attribute>``, for attributes in ``owned``:
    a write into another object's state."""
    return ((a.lineno, a.attr) for a in _assigned_attributes(tree)
            if a.attr in owned and not _on_self(a))


def test_no_module_writes_a_collaborators_state():
    """A collaborator's attributes are assigned in its own class only: others call it."""
    trees = {os.path.relpath(p, ROOT): ast.parse(open(p, encoding="utf-8").read())
             for p in _job_files()}
    found = []
    for path, cls in COLLABORATORS.items():
        owned = set(self_writes(_class_named(trees[path], cls)))
        assert owned, f"{cls} in {path} assigns nothing: is the table current?"
        for other, tree in trees.items():
            if other == path:
                continue
            found += [f"{other}:{line}: {attr} (owned by {cls})"
                      for line, attr in foreign_writes(tree, owned)]
    assert not found, "written from outside its owner: " + "; ".join(found)


def test_a_write_into_another_objects_state_is_seen():
    code = ("class B:\n def f(self, job):\n  self.open = 1\n  job.steps.open = False\n"
            "  runner.part += 1\n  x = job.steps.open\n")
    assert sorted(foreign_writes(ast.parse(code), {"open", "part"})) == [(4, "open"),
                                                                           (5, "part")]


def test_the_reader_sees_assignments_of_every_kind():
    code = ("class A:\n def f(self, o):\n  self.a = 1\n  self.b += 1\n  self.c: int = 2\n"
            "  self.d, (self.e, x) = 1, (2, 3)\n  y = self.f\n  o.g = 3\n")
    assert set(self_writes(ast.parse(code))) == {"a", "b", "c", "d", "e"}


HYPER_FIELDS = {"batch_size", "lr", "momentum", "base_lr", "base_batch_size", "ramp"}
# The training state creates and restores them (a checkpoint, a joiner's or a survivor's state);
# between steps only the adaptation writes them.
HYPER_WRITERS = {"hpcadapt/state/training.py", "hpcadapt/loop/adaptation.py"}


def hyper_writes(tree):
    """(line, what) of each assignment to ``<x>.hyper`` or to a field of the hyper-parameters
    through ``<x>.hyper.<field>`` or a name bound to ``<x>.hyper`` (``h = st.hyper``)."""
    aliases = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign)
               and isinstance(n.value, ast.Attribute) and n.value.attr == "hyper"
               for t in n.targets if isinstance(t, ast.Name)}
    for a in _assigned_attributes(tree):
        if a.attr == "hyper":
            yield a.lineno, "hyper"
        elif a.attr in HYPER_FIELDS and (
                (isinstance(a.value, ast.Attribute) and a.value.attr == "hyper")
                or (isinstance(a.value, ast.Name) and a.value.id in aliases)):
            yield a.lineno, f"hyper.{a.attr}"


def test_the_adaptation_is_the_one_writer_of_the_hyper_parameters():
    found = []
    for folder, _, names in os.walk(os.path.join(ROOT, "hpcadapt")):
        for name in names:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, ROOT)
            if not name.endswith(".py") or rel in HYPER_WRITERS:
                continue
            tree = ast.parse(open(path, encoding="utf-8").read())
            found += [f"{rel}:{line}: {what}" for line, what in hyper_writes(tree)]
    assert not found, "the hyper-parameters written outside the adaptation: " + "; ".join(found)


def test_the_hyper_parameter_reader_sees_aliases_and_plain_writes():
    code = ("def f(st, job):\n h = st.hyper\n h.lr = 1\n job.state.hyper.batch_size = 2\n"
            " st.hyper = 3\n other = st.sampler\n other.lr = 4\n")
    assert sorted(hyper_writes(ast.parse(code))) == [(3, "hyper.lr"), (4, "hyper.batch_size"),
                                                     (5, "hyper")]


def job_attributes():
    """The attributes the Job's class assigns on ``self``."""
    tree = ast.parse(open(os.path.join(ROOT, "hpcadapt", "job.py"), encoding="utf-8").read())
    return set(self_writes(_class_named(tree, "Job")))


def test_the_job_holds_references_and_delegates():
    """At most 16 attributes (issue 32; issue 45 added the phase): the options, the world,
    the training state, the user's model, optimizer, loader and extra state, the device, the
    job's phase, and the collaborators that own everything else; the Job is built from no
    mixin."""
    attributes = job_attributes()
    assert len(attributes) <= 16, sorted(attributes)
    tree = ast.parse(open(os.path.join(ROOT, "hpcadapt", "job.py"), encoding="utf-8").read())
    assert not _class_named(tree, "Job").bases, "the Job is one class, not mixins"


def test_every_option_has_one_group_and_is_read_through_it():
    """The options are split per collaborator (``JobOptions.steps``, ``.stops``, ...): each
    option belongs to one group, the flat keywords ``Job(...)`` takes land in it, and no
    module of the packages, the benchmarks or the examples reads an option past its group
    (``job.options.checkpoint`` would be an AttributeError at run time, found here first)."""
    import dataclasses

    import pytest

    from hpcadapt.base import options as options_mod
    from hpcadapt.base.options import JobOptions

    groups = {f.name: f.type for f in dataclasses.fields(JobOptions)}
    seen = collections.Counter(name for group in options_mod._GROUPS.values()
                               for name in group.__dataclass_fields__)
    assert set(options_mod._GROUPS) == set(groups)
    assert [name for name, n in seen.items() if n > 1] == []
    built = JobOptions.of(checkpoint="c", peer_timeout=5.0, lr_rule="sqrt", device="cpu")
    assert (built.stops.checkpoint, built.failures.peer_timeout, built.adaptation.lr_rule,
            built.comm.device) == ("c", 5.0, "sqrt", "cpu")
    with pytest.raises(TypeError, match="unknown option.*checkpoints"):
        JobOptions.of(checkpoints="c")
    flat = []
    for folder, _, names in [walked for package in ("hpcadapt", "policies", "cuda", "slurm",
                                                    "benchmarks", "examples")
                             for walked in os.walk(os.path.join(ROOT, package))]:
        for name in names:
            if not name.endswith(".py") or name == "options.py":
                continue
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
            for scope in ast.walk(tree):
                if not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
                    continue
                whole = {"options"} | _names_bound_to_options(scope)
                for node in ast.walk(scope):
                    if isinstance(node, ast.Attribute) and node.attr in seen \
                            and ast.unparse(node.value).split(".")[-1] in whole:
                        flat.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} "
                                    f"{ast.unparse(node)}")
    assert sorted(set(flat)) == [], sorted(set(flat))


def _names_bound_to_options(scope):
    """The local names a scope binds to the whole options (``o = job.options``,
    ``o, st = self.options, self.state``), not to one of its groups."""
    names = set()
    for node in ast.walk(scope):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            pairs = [(target, node.value)]
            if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                pairs = list(zip(target.elts, node.value.elts))
            for name, value in pairs:
                if isinstance(name, ast.Name) and ast.unparse(value).split(".")[-1] == "options":
                    names.add(name.id)
    return names


def test_the_options_reader_sees_aliases_of_the_whole_options():
    code = ("def f(job):\n    o, st = job.options, job.state\n    g = job.options.stops\n"
            "    return o.checkpoint, g.checkpoint\n")
    scope = ast.parse(code).body[0]
    assert _names_bound_to_options(scope) == {"o"}
