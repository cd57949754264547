"""Engine-side libraries: prefill and decode clients that drive NIXL (extra ``engine``)."""
