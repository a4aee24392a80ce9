#!/usr/bin/env bash
# Call B (stop 28, 2026-12-02 12:31 UTC, carry .stage/gguf/part.00): the first half of the SmolLM2 GGUF to /root/acc (the host is still warm).
mkdir -p /root/acc && cp .stage/gguf/part.00 /root/acc/ && ls -la /root/acc
