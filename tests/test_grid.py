import pytest

from flash_msa_rt.grid import GridRuleError, compile_rule


@pytest.mark.parametrize("rule, env, value", [
    ("ceil_div(S, 128)", {"S": 1}, 1),
    ("ceil_div(S, 128)", {"S": 128}, 1),
    ("ceil_div(S, 128)", {"S": 129}, 2),
    ("Hp * B", {"Hp": 8, "B": 3}, 24),
    ("min(132, ceil_div(S, 64) * H)", {"S": 1000, "H": 32}, 132),
    ("max(1, S // 256 - 1)", {"S": 100}, 1),
    ("7", {}, 7),
])
def test_rules_evaluate(rule, env, value):
    assert compile_rule(rule)(env) == value


@pytest.mark.parametrize("rule", ["__import__('os')", "S.bit_length()", "S ** 2", "[S]", "lambda: 1", "S +"])
def test_rules_reject_anything_else(rule):
    with pytest.raises(GridRuleError):
        compile_rule(rule)({"S": 3})


def test_unknown_name_is_named():
    with pytest.raises(GridRuleError, match="'T'"):
        compile_rule("T + 1")({"S": 3})
