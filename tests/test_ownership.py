"""One owner per value (issue 32): which of the Job's attributes are written from more than
one module of job.py and loop/ (a mixin per file, all writing ``self``). Reads the code.

Today's debt is recorded in ``SHARED``: the test fails when a new attribute gets a second
writer, and when a recorded one has lost it (then strike it from the list), so the list
only shrinks as the Job becomes collaborators that own their state."""

import ast
import collections
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Measured 2026-11-27: 41 attributes of the Job written from more than one file (most are
# set in Job.__init__ and written again by one mixin; _in_flight, _step_open and _prev_grads
# by four files). Repaid since: sink, _epoch_logged, _epoch_samples (loop/recording.py),
# _prev_grads, _prev_count (adapt/monitors.PreviousGradient); the step in flight, its
# timings, control values and micro-batch counters, 23 of them (loop/steps.StepRunner,
# loop/rounds.BoundedDelayRounds); _restart and joining, once the recovery became a
# collaborator that returns what it did (loop/failures.FailureRecovery).
SHARED = {
    "_holds_state", "_identical_after_resize", "_queued_hooks", "_requeue",
    "_resumed_at", "allocator", "elastic", "exit_code", "finished_by_stop_file",
    "left", "stopped",
}

# The Job's collaborators in loop/: each owns the attributes its class assigns on ``self``;
# no other module may assign them (``job.steps.open = False`` from a recovery, say).
COLLABORATORS = {
    "hpcadapt/loop/steps.py": "StepRunner",
    "hpcadapt/loop/rounds.py": "BoundedDelayRounds",
    "hpcadapt/loop/recording.py": "Recorder",
    "hpcadapt/loop/failures.py": "FailureRecovery",
    "hpcadapt/loop/monitoring.py": "Monitoring",
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
