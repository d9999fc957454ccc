import pytest
import torch

from hpcadapt import ConfigurationError
from hpcadapt.datasets import load_dataset
from hpcadapt.models import build_model, count_parameters


@pytest.mark.parametrize("name", ["mlp", "cnn", "resnet"])
@pytest.mark.parametrize("shape", [(1, 8, 8), (3, 32, 32)])
def test_models_map_inputs_to_logits(name, shape):
    m = build_model(name, shape, 10)
    assert m(torch.randn(4, *shape)).shape == (4, 10)
    assert count_parameters(m) > 1000


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_sequence_models_take_mnist1d_shaped_inputs(name):
    m = build_model(name, (1, 40), 10)
    assert m(torch.randn(4, 1, 40)).shape == (4, 10)
    if name == "cnn":
        assert any(isinstance(layer, torch.nn.Conv1d) for layer in m.modules())


def test_same_seed_same_weights():
    a, b = build_model("cnn", (1, 8, 8), 10, seed=5), build_model("cnn", (1, 8, 8), 10, seed=5)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_digits_split_is_real_data():
    d = load_dataset("digits")
    assert len(d.x_train) + len(d.x_test) == 1797
    assert d.x_train.shape[1:] == (1, 8, 8) and set(d.y_train.tolist()) == set(range(10))


def test_unknown_names_list_choices():
    with pytest.raises(ConfigurationError, match="choose one of"):
        build_model("vgg", (1, 8, 8), 10)
    with pytest.raises(ConfigurationError, match="digits"):
        load_dataset("imagenet")


def test_the_entry_point_knows_the_built_in_names_without_loading_torch():
    from hpcadapt.datasets import DATASETS
    from hpcadapt.models import MODELS
    from hpcadapt.train import DATASET_NAMES, MODEL_NAMES

    assert sorted(DATASET_NAMES) == sorted(DATASETS) and sorted(MODEL_NAMES) == sorted(MODELS)


def test_the_batch_norm_cnn_has_running_statistics_and_the_plain_one_none():
    plain = build_model("cnn", (1, 8, 8), 10, seed=5)
    bn = build_model("cnn", (1, 8, 8), 10, seed=5, batch_norm=True)
    assert not list(plain.buffers())
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in bn.modules()) == 3
    assert bn(torch.randn(4, 1, 8, 8)).shape == (4, 10)
