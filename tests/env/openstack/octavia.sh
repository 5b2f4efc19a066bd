start_octavia() { die "octavia: not written yet"; }
