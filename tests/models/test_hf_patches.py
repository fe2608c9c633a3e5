"""The one workaround onegpu applies to transformers (models/hf/patches.py) still matches the
function it stands in for: these fail when transformers renames, moves or stops calling it, or
answers differently for the rows onegpu feeds."""

import inspect

import torch

from onegpu.models.hf import patches


def _masking():
    import transformers.masking_utils as masking

    return masking


def test_the_patched_function_exists_with_the_same_signature():
    module, name = patches.PATCHED.rsplit(".", 1)
    masking = _masking()
    assert masking.__name__ == module
    original = getattr(masking, name)
    assert list(inspect.signature(original).parameters) == ["position_ids"]


def test_transformers_still_calls_it_by_its_module_global():
    """The patch swaps the module attribute: it only takes effect while transformers looks the
    function up there (a call in the module's own source, not only its definition)."""
    source = inspect.getsource(_masking())
    assert source.count("find_packed_sequence_indices(") >= 2  # the def and at least one call


def test_for_onegpus_rows_the_original_answers_what_the_patch_answers():
    positions = torch.arange(16).repeat(3, 1)  # every row 0..T-1: never packed
    assert _masking().find_packed_sequence_indices(positions) is None
    assert patches.not_packed(positions) is None


def test_the_patch_holds_only_inside_the_context():
    masking = _masking()
    original = masking.find_packed_sequence_indices
    with patches.never_packed():
        assert masking.find_packed_sequence_indices is patches.not_packed
    assert masking.find_packed_sequence_indices is original


def test_for_packed_rows_the_original_finds_the_documents_onegpu_reads():
    from onegpu.models.documents import document_ids

    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1], [0, 1, 2, 3, 4, 5, 0, 1]])
    found = _masking().find_packed_sequence_indices(positions)
    assert torch.equal(found, document_ids(positions))
    assert document_ids(positions).tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0] * 6 + [1, 1]]
