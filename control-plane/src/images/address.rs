//! Which addresses an image fetch may connect to. A server that fetches URLs its
//! clients name must not become their way into its own network (server-side request
//! forgery): loopback, private, link-local (cloud metadata at 169.254.169.254),
//! shared, benchmarking, multicast and reserved ranges are refused unless the
//! operator allows them.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Whether `ip` lies in a range a fetch is refused by default.
pub fn internal(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => internal_v4(v4),
        IpAddr::V6(v6) => internal_v6(v6),
    }
}

fn internal_v4(ip: Ipv4Addr) -> bool {
    let in_range = |net: [u8; 4], bits: u32| {
        let mask = u32::MAX.checked_shl(32 - bits).unwrap_or(0);
        u32::from(ip) & mask == u32::from(Ipv4Addr::from(net)) & mask
    };
    [
        ([0, 0, 0, 0], 8),      // "this network"
        ([10, 0, 0, 0], 8),     // private
        ([100, 64, 0, 0], 10),  // shared (carrier-grade NAT)
        ([127, 0, 0, 0], 8),    // loopback
        ([169, 254, 0, 0], 16), // link-local, cloud metadata
        ([172, 16, 0, 0], 12),  // private
        ([192, 0, 0, 0], 24),   // protocol assignments
        ([192, 168, 0, 0], 16), // private
        ([198, 18, 0, 0], 15),  // benchmarking
        ([224, 0, 0, 0], 4),    // multicast
        ([240, 0, 0, 0], 4),    // reserved, broadcast
    ]
    .into_iter()
    .any(|(net, bits)| in_range(net, bits))
}

fn internal_v6(ip: Ipv6Addr) -> bool {
    // An IPv4 address carried in IPv6 is judged as itself: mapped (::ffff:a.b.c.d) and
    // NAT64 (64:ff9b::a.b.c.d).
    let s = ip.segments();
    if s[..5] == [0, 0, 0, 0, 0] && s[5] == 0xffff || s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        let [a, b] = s[6].to_be_bytes();
        let [c, d] = s[7].to_be_bytes();
        return internal_v4(Ipv4Addr::new(a, b, c, d));
    }
    ip.is_unspecified() || ip.is_loopback() || ip.is_multicast() || ip.is_unique_local() || ip.is_unicast_link_local()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn internal_ranges_are_refused_and_public_ones_are_not() {
        let refused = [
            "0.0.0.0",
            "10.1.2.3",
            "100.64.0.1",
            "100.127.255.255",
            "127.0.0.1",
            "127.255.0.9",
            "169.254.169.254",
            "172.16.0.1",
            "172.31.255.255",
            "192.0.0.8",
            "192.168.1.1",
            "198.18.0.1",
            "198.19.255.255",
            "224.0.0.1",
            "239.255.255.250",
            "240.0.0.1",
            "255.255.255.255",
            "::",
            "::1",
            "fc00::1",
            "fd12:3456::1",
            "fe80::1",
            "ff02::1",
            "::ffff:127.0.0.1",
            "::ffff:10.0.0.1",
            "::ffff:169.254.169.254",
            "64:ff9b::192.168.0.1",
        ];
        for a in refused {
            assert!(internal(a.parse().unwrap()), "{a} should be refused");
        }
        let allowed = [
            "1.1.1.1",
            "8.8.8.8",
            "100.63.255.255",
            "100.128.0.0",
            "172.15.255.255",
            "172.32.0.0",
            "192.0.1.1",
            "192.169.0.1",
            "198.17.255.255",
            "198.20.0.0",
            "223.255.255.255",
            "2606:4700::1111",
            "::ffff:8.8.8.8",
            "64:ff9b::8.8.8.8",
        ];
        for a in allowed {
            assert!(!internal(a.parse().unwrap()), "{a} should be allowed");
        }
    }
}
