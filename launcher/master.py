"""MASTER_ADDR as an IP: a hostname is resolved with retries before preflight and msrun see it.

On Volcano the master's name (``<job>-worker-0.<job>``) comes from the ``svc`` plugin's headless
Service, which publishes a pod only once it is Ready unless the plugin is given
``--publish-not-ready-addresses=true`` (volcano-sh ``pkg/controllers/job/plugins/svc``); until then
the name does not resolve, and msrun's own conversion (``_convert_addr_to_ip``) raises at once with no
retry. The launcher therefore waits for the name here, up to ``launch.master_resolve_timeout_s``,
and hands msrun the address.
"""
from __future__ import annotations

import ipaddress
import socket
import time
from collections.abc import Callable

Resolver = Callable[[str], str]


class MasterUnresolved(RuntimeError):
    """The master's name did not resolve within the timeout; the message names the host, timeout and fix."""


def getaddr(host: str) -> str:
    """The first address ``getaddrinfo`` gives for ``host`` (as msrun would pick it)."""
    return str(socket.getaddrinfo(host, None, socket.AF_UNSPEC, socket.SOCK_STREAM)[0][4][0])


def is_ip(addr: str) -> bool:
    try:
        ipaddress.ip_address(addr.strip("[]"))
    except ValueError:
        return False
    return True


def resolve_master(host: str, timeout_s: float, resolver: Resolver = getaddr,
                   sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic,
                   log: Callable[[str], None] = print, poll_s: float = 2.0) -> str:
    """``host``'s address, retried every ``poll_s`` until ``timeout_s``; an IP is returned as it is."""
    if is_ip(host):
        return host
    deadline, tries = clock() + timeout_s, 0
    while True:
        tries += 1
        try:
            ip = resolver(host)
        except (OSError, IndexError) as e:  # socket.gaierror is an OSError
            if clock() >= deadline:
                raise MasterUnresolved(
                    f"MASTER_ADDR={host} did not resolve within launch.master_resolve_timeout_s={timeout_s:g} s "
                    f"({tries} tries; last: {e}). On Volcano the svc plugin publishes pod 0's name only once it is "
                    "Ready unless it has --publish-not-ready-addresses=true (render adds it); otherwise set "
                    "MASTER_ADDR to node 0's IP, or raise the wait (OVERRIDES='launch.master_resolve_timeout_s=1200')"
                ) from None
            if tries == 1:
                log(f"MASTER_ADDR={host} does not resolve yet ({e}); retrying every {poll_s:g} s for up to "
                    f"{timeout_s:g} s (launch.master_resolve_timeout_s)")
            sleep(min(poll_s, max(0.0, deadline - clock())))
            continue
        log(f"MASTER_ADDR={host} resolves to {ip}" + (f" after {tries} tries" if tries > 1 else "") +
            "; msrun gets the address")
        return ip
