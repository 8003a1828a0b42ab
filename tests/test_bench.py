"""bench.py's own bookkeeping on the tiny model (its timings are not tested, only that they measure something)."""
import bench


def test_decode_parts_finds_the_products_and_the_attention_in_the_profile(tiny_policy):
    # if torch renamed the kernels (PRODUCT_OPS, ATTENTION_OPS), both would read 0 and the bound would be infinite
    stops = list(tiny_policy.stop_ids)
    parts = bench.bench_decode_parts(tiny_policy, rows=4, context=20, steps=3)
    assert parts["decode_step_products_ms_4"] > 0
    assert parts["decode_step_attention_ms_4"] > 0
    assert parts["decode_step_products_ms_4"] + parts["decode_step_attention_ms_4"] < parts["decode_step_profiled_ms_4"]
    assert tiny_policy.stop_ids == stops   # bench decodes without stop tokens, then gives them back
