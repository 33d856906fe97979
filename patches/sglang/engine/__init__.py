"""What wraps sglang's classes and starts with the scheduler: the version adapters and their
hook tables, the scheduler start-up, admission, the request guard, the HTTP routes, the DP
controller hook, server options, the doctor and the KV canary recorder."""
