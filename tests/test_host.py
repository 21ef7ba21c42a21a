"""Every kind of parameter host offers the whole ParamHost protocol, as the protocol names it."""

import inspect

import pytest

from distbelief.host import ParamHost
from distbelief.modelpar.host import PartitionedHost
from distbelief.ps.host import FlatHost
from distbelief.sparse.host import RowSparseHost

PROTOCOL = {name: member for name, member in vars(ParamHost).items()
            if inspect.isfunction(member) and not name.startswith("_")}


def parameter_names(function) -> list[str]:
    return list(inspect.signature(function).parameters)


@pytest.mark.parametrize("host", [FlatHost, PartitionedHost, RowSparseHost])
def test_host_implements_every_protocol_method_with_its_parameters(host):
    assert set(PROTOCOL) == {"fetch", "forward_backward", "end_step", "versions", "after_run",
                             "finish", "counters", "partitions", "load_vector", "hold",
                             "settle", "stage", "discard"}
    for name, member in PROTOCOL.items():
        assert parameter_names(getattr(host, name)) == parameter_names(member), name
    assert isinstance(host.event_fields, dict)
