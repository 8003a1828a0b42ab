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


def test_decode_share_times_the_sampler_against_its_own_products(tiny_policy):
    # the products are part of every decode step, so the sampler can only be slower than them alone
    shares = bench.bench_decode_share(tiny_policy, rows=4, context=20, steps=3, rounds=2)
    assert 0 < shares["decode_share_of_cap_4"] < 1
    assert 0 < shares["decode_share_of_prepacked_cap_4"] < 1


def test_onednn_bench_times_both_product_paths(tiny_policy):
    stops = list(tiny_policy.stop_ids)
    result = bench.bench_onednn(tiny_policy, rows=(2,), context=20, steps=2, rounds=1)
    assert result["onednn_vs_linear_decode_2"] > 0 and result["decode_tok_s_sampler_2_linear"] > 0
    assert result["decoder_setup_ms_onednn"] > 0 and result["decoder_setup_ms_linear"] > 0
    assert tiny_policy.stop_ids == stops


def test_keep_freed_memory_bench_leaves_memory_kept(tiny_policy, resident_bytes_freed):
    import platform

    from sampler import keep_freed_memory
    result = bench.bench_keep_freed_memory(tiny_policy, rows=4, context=20, steps=3, rounds=1)
    try:
        if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
            assert result == {}   # nothing to compare
            return
        assert result["keep_freed_memory_decode_4"] > 0 and result["decode_tok_s_sampler_4_glibc_default"] > 0
        resident_bytes_freed()
        assert resident_bytes_freed() < 8 << 20   # as train.py runs: freed memory stays in the process
    finally:
        keep_freed_memory(False)
