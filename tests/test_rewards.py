import pytest

from zerosim.agent.protocol import extract_answer
from zerosim.agent.rewards import answer_reward, make_reward_func


def test_extract_answer():
    assert extract_answer("<think>x</think><answer> Lima </answer>") == "Lima"
    assert extract_answer("<answer>a</answer> more <answer>b</answer>") == "b"
    assert extract_answer("<answer>unterminated") is None
    assert extract_answer("") is None


def test_missing_answer_scores_zero_for_every_metric():
    for metric in ("em", "f1", "cover_em"):
        assert answer_reward(None, ["Lima"], metric) == 0.0


def test_reward_func_normalises_and_uses_final_answer():
    em = make_reward_func("em")
    assert em.__name__ == "em"
    scores = em(
        prompts=["p"] * 4,
        completions=["<answer>ignored</answer>"] * 4,
        final_answer=["The Lima.", "lima", None, "Cusco"],
        golden_answers=[["Lima"], ["Lima", "Lim"], ["Lima"], ["Lima"]],
    )
    assert scores == [1.0, 1.0, 0.0, 0.0]
    cover = make_reward_func("cover_em")
    assert cover(
        prompts=[""], completions=[""], final_answer=["it is Lima, Peru"], golden_answers=[["lima"]]
    ) == [1.0]
    f1 = make_reward_func("f1")
    (score,) = f1(
        prompts=[""], completions=[""], final_answer=["presidential republic"], golden_answers=[["republic"]]
    )
    assert abs(score - 2 / 3) < 1e-9


def test_format_shaped_reward_matches_search_r1_table():
    from zerosim.agent.rewards import format_shaped

    lam = 0.2
    assert format_shaped(1.0, True, True, lam) == 1.0
    assert abs(format_shaped(1.0, True, False, lam) - 0.8) < 1e-12
    assert abs(format_shaped(0.0, True, True, lam) - 0.2) < 1e-12
    assert abs(format_shaped(0.0, True, False, lam) - 0.1) < 1e-12
    assert format_shaped(0.0, False, False, lam) == 0.0
    assert format_shaped(0.7, True, False, 0.0) == 0.7


def test_reward_func_with_format_weight_uses_valid_format():
    r = make_reward_func("em", format_weight=0.2)
    scores = r(
        prompts=[""] * 3,
        completions=[""] * 3,
        final_answer=["Lima", "Cusco", None],
        golden_answers=[["Lima"]] * 3,
        valid_format=[False, True, False],
    )
    assert [round(s, 6) for s in scores] == [0.8, 0.2, 0.0]


def test_composed_outcome_by_weights():
    from zerosim.agent.rewards import make_reward_func

    f = make_reward_func("em", weights={"em": 0.5, "f1": 0.5})
    # "Lima Peru" vs "Lima": em 0, f1 = 2·(1/2·1)/(1/2+1) = 2/3
    out = f([None] * 3, [None] * 3, final_answer=["Lima", "Lima Peru", None], golden_answers=[["Lima"]] * 3)
    assert out == pytest.approx([1.0, 0.5 * 2 / 3, 0.0])
    assert f.__name__ == "outcome"
    with pytest.raises(ValueError, match="reward weights take"):
        make_reward_func("em", weights={"bleu": 1.0})


def test_reward_weights_config_is_checked():
    from zerosim.core.config import ConfigError
    from zerosim.training.config import load_train_config

    weights = load_train_config(None, ["reward.weights={em: 0.5, f1: 0.5}"]).reward.weights
    assert weights == {"em": 0.5, "f1": 0.5}
    with pytest.raises(ConfigError, match="reward.weights takes em, f1, cover_em"):
        load_train_config(None, ["reward.weights={rouge: 1.0}"])
