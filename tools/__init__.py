"""The course's own machinery: preflight, tracer, mutation check, chain diffs, data and stand-ins."""
