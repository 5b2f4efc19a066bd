//! What enforces NetworkPolicy besides the binders' nftables: the Neutron security-group
//! backend ([`neutron`], `--backend neutron`).

pub mod neutron;
