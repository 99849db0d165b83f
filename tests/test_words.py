from mpitrain.words import plural


def test_plural_is_singular_for_one_only():
    assert plural(1, "shard") == "1 shard"
    assert [plural(n, "step") for n in (0, 2, 10)] == ["0 steps", "2 steps", "10 steps"]
    assert plural(1, "unseen speaker") == "1 unseen speaker"
    assert plural(3, "child", "children") == "3 children"
