"""highrank.config: defaults, TOML files, overrides, strict errors, and the TOML writer."""

from __future__ import annotations

import dataclasses
import tomllib

import pytest

from highrank.config import (
    Config,
    ConfigError,
    HeadConfig,
    TrainConfig,
    config_from_dict,
    config_to_dict,
    dump_toml,
    load_config,
    parse_override,
    save_config,
    toml_value,
    validate_config,
)
from highrank.heads import HEADS, head_knobs

MOS_FILE = """\
# MoS on PTB
[data]
dir = "data/penn"

[model]
d_embed = 280
d_hidden = 960
d_last = 620

[head]
name = "mos"
n_components = 15
latent_dropout = 0.29

[train]
batch_size = 12
lr = 20
"""


@pytest.fixture
def mos_file(tmp_path):
    path = tmp_path / "mos.toml"
    path.write_text(MOS_FILE)
    return path


def write(tmp_path, text: str):
    path = tmp_path / "exp.toml"
    path.write_text(text)
    return path


def error_of(*args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(*args, **kwargs)
    return str(info.value)


# ---- defaults and loading ---------------------------------------------------------------------


def test_defaults_are_valid_and_equal_an_empty_load():
    validate_config(Config())
    assert load_config() == Config()
    assert load_config(None, []) == Config()


def test_every_head_loads_with_its_default_knobs():
    for name in HEADS:
        # MFS and CPR read the last 3 layers by default, which the Transformer family gives
        family = "transformer" if HEADS[name].reads != ("hidden",) else "awd-lstm"
        config = load_config(None, [f"head.name={name}", f"model.backbone={family}"])
        expected = {k: v for k, v in head_knobs(name).items() if v is not None}
        expected = {k: v for k, v in expected.items() if k not in ("d_embed", "tied_weight")}
        assert config.head.knobs == expected


def test_a_family_that_cannot_give_a_head_what_it_reads_says_so():
    """AWD-LSTM gives a head its last layer only; the translation decoder its hidden states
    alone (MFS and CPR also read the context's layers and tokens)."""
    with pytest.raises(ConfigError, match=r"head.input_layers = 3 is more layers than "
                       r'model.backbone = "awd-lstm" gives a head \(1: its last only'):
        load_config(None, ["head.name=cpr"])
    config = load_config(None, ["head.name=cpr", "head.input_layers=1"])
    assert config.head.knobs["input_layers"] == 1
    load_config(None, ["head.name=mfs", "head.multi_input=false"])  # the top layer alone
    with pytest.raises(ConfigError, match=r"head.input_layers = 4 is more layers than "
                       r'model.backbone = "transformer" gives a head \(3: model.n_layers \+ 1'):
        load_config(None, ["head.name=mfs", "model.backbone=transformer", "model.n_layers=2",
                           "head.input_layers=4"])
    with pytest.raises(ConfigError, match=r'head.name = "cpr" reads hidden, layers, context_ids, '
                       r'but model.backbone = "seq2seq" gives a head its hidden states alone'):
        load_config(None, ["head.name=cpr", "model.backbone=seq2seq", "data.src_lang=de",
                           "data.tgt_lang=en"])
    with pytest.raises(ConfigError, match=r"head.time_dim is set by the model"):
        load_config(None, ["head.name=cpr", "model.backbone=transformer", "head.time_dim=1"])


def test_toml_file_is_merged_onto_defaults(mos_file):
    config = load_config(mos_file)
    assert config.data.dir == "data/penn"
    assert (config.model.d_embed, config.model.d_hidden, config.model.d_last) == (280, 960, 620)
    assert config.model.n_layers == 3  # default kept
    assert config.head.name == "mos"
    assert config.head.knobs == {
        "n_components": 15,
        "latent_dropout": 0.29,
        "residual_contexts": False,
    }
    assert config.train.lr == 20.0 and isinstance(config.train.lr, float)  # int accepted
    assert config.train.batch_size == 12
    assert config.train.bptt == 70


def test_overrides_beat_the_file_and_later_overrides_win(mos_file):
    config = load_config(mos_file, ["train.lr=25", "--train.batch_size=15", "train.lr=22.5"])
    assert config.train.lr == 22.5
    assert config.train.batch_size == 15
    assert config.model.d_embed == 280  # from the file


@pytest.mark.parametrize(
    "override, section, key, expected",
    [
        ("train.lr=20", "train", "lr", 20.0),
        ("--train.weight_decay=1e-5", "train", "weight_decay", 1e-5),
        ("model.tie_weights=false", "model", "tie_weights", False),
        ('head.name="gss"', "head", "name", "gss"),
        ("head.name=gss", "head", "name", "gss"),
        ("train.optimizer=et-asgd", "train", "optimizer", "et-asgd"),
        ("run.out_dir=2024", "run", "out_dir", "2024"),  # string fields keep the text
        ("run.out_dir = runs/x y ", "run", "out_dir", "runs/x y"),
        ("data.cache_dir=/tmp/cache", "data", "cache_dir", "/tmp/cache"),
        ("train.chunk_size=4096", "train", "chunk_size", 4096),
    ],
)
def test_override_values_are_toml_literals_or_text(override, section, key, expected):
    value = getattr(getattr(load_config(None, [override]), section), key)
    assert value == expected and type(value) is type(expected)


def test_head_knob_override_and_int_to_float_knob():
    config = load_config(None, ["head.name=gss", "head.slope=3", "head.center=-1.5"])
    assert config.head.knobs == {"center": -1.5, "slope": 3.0, "learn_shape": False}
    assert isinstance(config.head.knobs["slope"], float)


def test_config_from_dict_names_its_source():
    config = config_from_dict({"train": {"epochs": 3}}, ["train.switch_epoch=1"])
    assert (config.train.epochs, config.train.switch_epoch) == (3, 1)
    with pytest.raises(ConfigError, match=r"checkpoint\.pt: unknown key 'train\.epoch'"):
        config_from_dict({"train": {"epoch": 3}}, source="checkpoint.pt")


# ---- errors -----------------------------------------------------------------------------------


def test_unknown_section_names_file_line_and_valid_sections(tmp_path):
    path = write(tmp_path, '[data]\ndir = "x"\n\n[trian]\nlr = 3\n')
    message = error_of(path)
    assert f"{path}, line 4" in message
    assert "unknown section 'trian'" in message
    assert "train" in message and "dynamic_eval" in message


def test_unknown_key_names_dotted_key_file_line_and_valid_keys(tmp_path):
    path = write(tmp_path, "[train]\nbatch_size = 12\nlearning_rate = 3\n")
    message = error_of(path)
    assert f"{path}, line 3" in message
    assert "unknown key 'train.learning_rate'" in message
    assert "lr" in message and "weight_decay" in message and "bptt" in message


def test_unknown_key_in_an_override():
    message = error_of(None, ["model.dropout=0.3"])
    assert "override 'model.dropout=0.3'" in message
    assert "unknown key 'model.dropout'" in message
    assert "dropout_output" in message


def test_wrong_type_names_key_value_type_and_expected(tmp_path):
    path = write(tmp_path, '[train]\n\nbptt = "seventy"\n')
    message = error_of(path)
    assert f"{path}, line 3" in message
    assert 'train.bptt = "seventy" has type str; expected int' in message


def test_float_for_int_is_an_error():
    message = error_of(None, ["train.batch_size=12.5"])
    assert "train.batch_size = 12.5 has type float; expected int" in message


@pytest.mark.parametrize("override", ["train.batch_size=true", "train.lr=false"])
def test_bool_is_never_a_number(override):
    message = error_of(None, [override])
    assert "has type bool" in message and "booleans are not numbers" in message


def test_string_for_float_says_int_is_accepted():
    message = error_of(None, ["train.lr=fast"])
    assert 'train.lr = "fast" has type str; expected float (an int is accepted)' in message


def test_number_for_bool_is_an_error():
    message = error_of(None, ["model.tie_weights=1"])
    assert "model.tie_weights = 1 has type int; expected bool" in message


@pytest.mark.parametrize("spelling", ["False", "TRUE"])
def test_a_capitalised_bool_says_toml_spells_it_lower_case(spelling):
    message = error_of(None, [f"model.tie_weights={spelling}"])
    assert message.endswith(f'model.tie_weights = "{spelling}" has type str; expected bool '
                            f"(TOML booleans are lower case: {spelling.lower()})"), message


def test_a_quoted_bool_in_a_file_says_toml_booleans_are_unquoted(tmp_path):
    message = error_of(write(tmp_path, '[model]\ntie_weights = "true"\n'))
    assert message.endswith('model.tie_weights = "true" has type str; expected bool '
                            "(TOML booleans are unquoted: true)"), message


def test_section_must_be_a_table(tmp_path):
    message = error_of(write(tmp_path, "train = 3\n"))
    assert "'train' must be a table ([train])" in message


def test_unknown_head_knob_lists_the_valid_knobs(tmp_path):
    path = write(tmp_path, '[head]\nname = "mos"\nn_mixtures = 10\n')
    message = error_of(path)
    assert f"{path}, line 3" in message
    assert "head 'mos' has no knob 'n_mixtures'" in message
    assert "n_components (default 15)" in message and "latent_dropout (default 0.29)" in message


def test_knobs_are_checked_against_the_final_head_name(mos_file):
    message = error_of(mos_file, ["head.name=gss"])
    assert "head 'gss' has no knob 'n_components'" in message
    assert "center (default -1.5)" in message and "slope (default 2.5)" in message


def test_head_without_knobs_says_none():
    assert "valid knobs for 'softmax': none" in error_of(None, ["head.gate_dim=3"])


def test_model_set_knobs_are_refused():
    message = error_of(None, ["head.tied_weight=true"])
    assert "head.tied_weight is set by the model" in message


def test_knob_type_is_checked_against_its_default():
    message = error_of(None, ["head.name=mos", "head.n_components=2.5"])
    assert "head.n_components = 2.5 has type float; expected int" in message


def test_unknown_head_name_lists_heads():
    message = error_of(None, ["head.name=moss"])
    assert 'head.name = "moss" is not a known head' in message
    assert "mos" in message and "mixtape" in message


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.lr", "has no '='; write section.key=value"),
        ("lr=20", "the key 'lr' must be section.key"),
        ("train.lr.x=2", "the key 'train.lr.x' must be section.key"),
        (".lr=2", "the key '.lr' must be section.key"),
    ],
)
def test_bad_override_syntax(override, expected):
    assert expected in error_of(None, [override])
    with pytest.raises(ConfigError):
        parse_override(override)


@pytest.mark.parametrize(
    "override, expected",
    [
        ("model.dropout_output=1.0", "model.dropout_output = 1.0 is out of range; expected a prob"),
        ("model.weight_drop=-0.1", "expected a probability in [0, 1)"),
        ("train.batch_size=0", "train.batch_size = 0 is out of range; expected > 0"),
        ("train.checkpoint_every=0", "train.checkpoint_every = 0 is out of range; expected > 0"),
        ("train.lr=inf", "train.lr = inf is out of range; expected a finite number > 0"),
        ("train.lr=nan", "train.lr = nan is out of range"),
        ("train.optimizer=adam", "expected one of: 'nt-asgd', 'et-asgd', 'sgd'"),
        ("data.mode=byte", "expected one of: 'word', 'char'"),
        ("model.backbone=gru", "expected one of: 'awd-lstm'"),
        ("run.device=gpu", "'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'"),
        ("data.dir=''", 'data.dir = "" is out of range; expected a non-empty string'),
        ("train.seed=-1", "train.seed = -1 is out of range"),
    ],
)
def test_value_constraints(override, expected):
    message = error_of(None, [override])
    assert f"override {override!r}" in message
    assert expected in message


def test_et_asgd_switch_epoch_must_come_before_the_last_epoch():
    message = error_of(None, ["train.optimizer=et-asgd", "train.epochs=100"])
    assert "train.switch_epoch = 200 with train.epochs = 100" in message
    # a review: the rule named the defaulted switch_epoch's origin, not the override given
    assert message.startswith("override 'train.epochs=100': ")
    assert load_config(None, ["train.optimizer=et-asgd", "train.switch_epoch=50"])


def test_a_latest_switch_epoch_bounds_nt_asgd_only():
    config = load_config(None, ["train.latest_switch_epoch=12"])
    assert (config.train.optimizer, config.train.latest_switch_epoch) == ("nt-asgd", 12)
    assert load_config(None, []).train.latest_switch_epoch is None
    message = error_of(None, ["train.optimizer=et-asgd", "train.switch_epoch=5",
                              "train.latest_switch_epoch=12"])
    assert "train.latest_switch_epoch bounds nt-asgd's switch" in message
    assert "expected > 0" in error_of(None, ["train.latest_switch_epoch=0"])


def test_invalid_toml_and_missing_file(tmp_path):
    path = write(tmp_path, "[train\nlr = 3\n")
    assert f"{path}: invalid TOML" in error_of(path)
    assert "not found" in error_of(tmp_path / "nope.toml")


def test_a_mistyped_config_path_names_the_closest_files(tmp_path):
    """Issue 29: a config path typo got no "did you mean" (keys do), in the file's name or
    in its folder's."""
    (tmp_path / "ptb").mkdir()
    for name in ("small-softmax.toml", "small-mos.toml", "awd-lstm-mixtape.toml"):
        (tmp_path / "ptb" / name).write_text("# defaults\n")
    message = error_of(tmp_path / "ptb" / "small-softmx.toml")
    assert f"did you mean {tmp_path / 'ptb' / 'small-softmax.toml'}" in message
    assert "awd-lstm-mixtape" not in message
    message = error_of(tmp_path / "pbt" / "small-mos.tml")  # the folder and the suffix too
    assert f"did you mean {tmp_path / 'ptb' / 'small-mos.toml'}" in message
    assert "did you mean" not in error_of(tmp_path / "ptb" / "transformer-plif.toml")
    assert "is a folder; expected a TOML file" in error_of(tmp_path / "ptb")


def test_validate_config_checks_a_config_built_in_code():
    config = Config()
    config.head = HeadConfig(name="mos", knobs={"n_mixtures": 3})
    unset = "^a default or a value set in code: "  # no file line or override to name
    with pytest.raises(ConfigError, match=unset + "head 'mos' has no knob 'n_mixtures'"):
        validate_config(config)
    config = Config(train=TrainConfig(batch_size=-1))
    with pytest.raises(ConfigError, match=unset + r"train.batch_size = -1 is out of range"):
        validate_config(config)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# ---- writing ----------------------------------------------------------------------------------


def test_dump_round_trips(tmp_path, mos_file):
    configs = [
        Config(),
        load_config(mos_file),
        load_config(None, ["head.name=plif", "head.learn_slopes=false", "train.chunk_size=64"]),
        load_config(None, ["head.name=mixtape", "train.weight_decay=1.2e-6", "train.clip=0"]),
        load_config(None, ['run.out_dir="odd \\"dir\\"\\t\\u00e9\\\\ =[x]"', "data.mode=char"]),
    ]
    for config in configs:
        path = tmp_path / "resolved.toml"
        save_config(config, path)
        assert load_config(path) == config
        assert tomllib.loads(dump_toml(config)) == _without_none(config_to_dict(config))


def test_dump_leaves_unset_keys_out():
    text = dump_toml(Config())
    assert "d_last" not in text and "chunk_size" not in text and "cache_dir" not in text
    assert '[head]\nname = "softmax"' in text


def test_config_to_dict_shape():
    table = config_to_dict(load_config(None, ["head.name=mos"]))
    assert list(table) == [f.name for f in dataclasses.fields(Config)]
    assert table["head"] == {
        "name": "mos",
        "n_components": 15,
        "latent_dropout": 0.29,
        "residual_contexts": False,
    }
    assert table["model"]["d_last"] is None


@pytest.mark.parametrize(
    "value",
    [0, -3, 1.5, 1e-300, 1.2e-6, 1e20, True, "", 'a"b\\c\nd\x00\x7f é😀', [1, 2.5, "x"], []],
)
def test_toml_value_parses_back(value):
    assert tomllib.loads(f"v = {toml_value(value)}")["v"] == value


def test_toml_value_refuses_other_types():
    with pytest.raises(ConfigError, match="cannot write"):
        toml_value(None)


def _without_none(table: dict) -> dict:
    return {s: {k: v for k, v in t.items() if v is not None} for s, t in table.items()}
