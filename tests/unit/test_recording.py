"""The Recorder on its own: the epoch line from the steps it was told of, the user's last
metrics, a new rank 0 taking the file over, and a disabled recorder (ranks other than 0)
writing nothing."""

import json
import math

from hpcadapt.loop.recording import Recorder


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_epoch_line_comes_from_the_steps_counted_since_the_epoch_started(tmp_path):
    path = tmp_path / "m.jsonl"
    r = Recorder(str(path), enabled=True)
    r.count_step(32, 9.0)             # the last epoch's: forgotten at the start
    r.start_epoch()
    assert not r.epoch_logged
    r.count_step(32, 2.0)
    r.count_step(16, float("nan"))    # a step that trained nothing: no loss
    r.count_step(32, 1.0)
    rec = r.write_epoch(step=3, epoch=0, world_size=2, batch_size=32, lr=0.1,
                        test_accuracy=None, cluster_version=1, user={"ema": 0.5})
    assert r.epoch_logged and rec.loss == 1.5 and math.isnan(rec.test_accuracy)
    assert rec.samples_per_s > 0
    r.write_epoch(step=6, epoch=1, world_size=2, batch_size=32, lr=0.1, test_accuracy=0.9,
                  cluster_version=1, user={"ema": 0.75, "other": 2.0})
    assert r.user_metrics == {"ema": 0.75, "other": 2.0}
    r.close()
    rows = _rows(path)
    assert [row["event"] for row in rows] == ["epoch", "epoch"]
    assert rows[0]["ema"] == 0.5 and rows[1]["test_accuracy"] == 0.9


def test_a_new_rank_0_appends_to_the_file_and_other_ranks_write_nothing(tmp_path):
    path = tmp_path / "m.jsonl"
    first = Recorder(str(path), enabled=True)
    first.write({"event": "step", "step": 1})
    first.close()
    quiet = Recorder(str(path), enabled=False)
    quiet.write({"event": "step", "step": 99})
    quiet.take_over(str(path))       # a recovery made it rank 0
    quiet.write({"event": "recovery", "step": 2})
    quiet.close()
    assert [(row["event"], row["step"]) for row in _rows(path)] == [("step", 1),
                                                                    ("recovery", 2)]
