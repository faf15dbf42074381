"""The tool server's option objects (`Limits`, `Access`, `KernelConfinement`) and the flat keywords
they group, which still work."""

from __future__ import annotations

from pathlib import Path

import pytest

from ipybox.app.sandbox import KernelConfinement
from ipybox.app.tools import Access, Limits, ToolServer


def test_limits_given_as_an_option_object_or_as_keywords_are_the_same() -> None:
    grouped = ToolServer(limits=Limits(max_result_size=10, max_request_size=20, max_inflight_size=30))
    flat = ToolServer(max_result_size=10, max_request_size=20, max_inflight_size=30)
    assert grouped.limits == flat.limits == Limits(10, 20, 30)
    assert (flat.max_result_size, flat.max_request_size, flat.max_inflight_size) == (10, 20, 30)


def test_access_given_as_an_option_object_or_as_keywords_is_the_same() -> None:
    grouped = ToolServer(access=Access(token="t", approval_secret="s"))
    flat = ToolServer(token="t", approval_secret="s")
    assert (grouped.token, grouped.approval_secret) == (flat.token, flat.approval_secret) == ("t", "s")
    secured = ToolServer()
    assert secured.token and secured.approval_secret and secured.token != secured.approval_secret
    open_mode = ToolServer(access=Access(trust_all_clients=True))
    assert open_mode.trust_all_clients and open_mode.token is None and open_mode.approval_secret is None


def test_the_kernels_confinement_given_as_an_object_or_as_keywords_is_the_same(tmp_path: Path) -> None:
    grouped = ToolServer(confinement=KernelConfinement(writable=(tmp_path,)))
    flat = ToolServer(kernel_writable=(tmp_path,))
    assert grouped.confinement == flat.confinement == KernelConfinement(writable=(tmp_path,))


def test_a_setting_given_twice_or_unknown_is_refused_with_what_to_do() -> None:
    with pytest.raises(TypeError, match="give each setting once"):
        ToolServer(limits=Limits(), max_result_size=10)
    with pytest.raises(TypeError, match="unexpected keyword"):
        ToolServer(max_size=10)  # type: ignore[call-arg]  # the mistake under test


def test_a_limit_that_is_not_a_positive_number_of_bytes_is_refused() -> None:
    with pytest.raises(ValueError, match="max_request_size must be a positive number of bytes"):
        Limits(max_request_size=0)
    with pytest.raises(ValueError, match="max_inflight_size must be a positive number of bytes"):
        ToolServer(max_inflight_size=-1)
