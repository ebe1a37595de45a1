"""Envoy's static config as every benchmark runs it: a plain HTTP/1.1 reverse proxy.

Used by the CPU benchmarks (`proxies.start_envoy`: bench_passthrough, bench_replay) and by
the live one on the GPU machine (tests/e2e/bench.py). Standard library only, so the GPU
machine's Python imports it as it is. What differs between them is an argument:
`idle_timeout` (the live run turns every timeout a stream could hit off, "0s"; the CPU runs
keep an idle bound), `limits` (the CPU runs' buffer limit and raised circuit breakers for
their 256 streams and more), and the comment and virtual host's name each config carried.
"""

from __future__ import annotations

HCM = (
    "type.googleapis.com/"
    "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
)
ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
BUFFER_LIMIT = 1 << 20  # per connection, bytes
BREAKERS = 100_000  # connections, pending requests and requests, each

TEMPLATE = """\
{comment}static_resources:
  listeners:
  - name: ingress
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
{listener_limits}    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": {hcm}
          stat_prefix: ingress
          codec_type: HTTP1
          stream_idle_timeout: {idle}
          request_timeout: 0s
          route_config:
            virtual_hosts:
            - name: {virtual_host}
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: vllm, timeout: 0s, idle_timeout: {idle}}}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": {router}
  clusters:
  - name: vllm
    type: STATIC
    connect_timeout: 5s
{cluster_limits}    load_assignment:
      cluster_name: vllm
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {upstream}}}}}}}
"""


def envoy_config(
    port: int,
    upstream: int,
    *,
    idle_timeout: str,
    limits: bool,
    comment: str,
    virtual_host: str,
) -> str:
    """Envoy listening on 127.0.0.1:`port` in front of 127.0.0.1:`upstream`: the router
    only (it streams bodies both ways, no buffering), no request or route timeout.

    `idle_timeout`: the stream's and the route's idle timeout ("0s": off). `limits`: a
    per-connection buffer limit of 1 MiB (listener and cluster) and circuit breakers at
    100,000; else Envoy's defaults. `comment`: the YAML comment above the config, each line
    starting with "# "."""
    if any(not line.startswith("# ") for line in comment.splitlines()):
        raise ValueError("every line of the comment starts with '# '")
    listener = f"    per_connection_buffer_limit_bytes: {BUFFER_LIMIT}\n" if limits else ""
    cluster = (
        f"    per_connection_buffer_limit_bytes: {BUFFER_LIMIT}\n"
        "    circuit_breakers:\n"
        "      thresholds:\n"
        f"      - {{max_connections: {BREAKERS}, max_pending_requests: {BREAKERS}, "
        f"max_requests: {BREAKERS}}}\n"
        if limits
        else ""
    )
    return TEMPLATE.format(
        comment=comment.rstrip("\n") + "\n" if comment else "",
        port=port,
        upstream=upstream,
        hcm=HCM,
        router=ROUTER,
        idle=idle_timeout,
        virtual_host=virtual_host,
        listener_limits=listener,
        cluster_limits=cluster,
    )
