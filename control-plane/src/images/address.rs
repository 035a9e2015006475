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
        ([0, 0, 0, 0], 8),       // "this network"
        ([10, 0, 0, 0], 8),      // private
        ([100, 64, 0, 0], 10),   // shared (carrier-grade NAT)
        ([127, 0, 0, 0], 8),     // loopback
        ([169, 254, 0, 0], 16),  // link-local, cloud metadata
        ([172, 16, 0, 0], 12),   // private
        ([192, 0, 0, 0], 24),    // protocol assignments
        ([192, 0, 2, 0], 24),    // documentation
        ([192, 168, 0, 0], 16),  // private
        ([198, 18, 0, 0], 15),   // benchmarking
        ([198, 51, 100, 0], 24), // documentation
        ([203, 0, 113, 0], 24),  // documentation
        ([224, 0, 0, 0], 4),     // multicast
        ([240, 0, 0, 0], 4),     // reserved, broadcast
    ]
    .into_iter()
    .any(|(net, bits)| in_range(net, bits))
}

fn internal_v6(ip: Ipv6Addr) -> bool {
    let s = ip.segments();
    let v4 = |hi: u16, lo: u16| {
        let ([a, b], [c, d]) = (hi.to_be_bytes(), lo.to_be_bytes());
        Ipv4Addr::new(a, b, c, d)
    };
    // An IPv4 address carried in IPv6 is judged as itself: IPv4-compatible (::a.b.c.d,
    // which covers :: and ::1), mapped (::ffff:a.b.c.d), translated (::ffff:0:a.b.c.d),
    // NAT64 (64:ff9b::a.b.c.d) and 6to4 (2002:aabb:ccdd::).
    if s[..6] == [0; 6]
        || s[..6] == [0, 0, 0, 0, 0, 0xffff]
        || s[..6] == [0, 0, 0, 0, 0xffff, 0]
        || s[..6] == [0x64, 0xff9b, 0, 0, 0, 0]
    {
        return internal_v4(v4(s[6], s[7]));
    }
    if s[0] == 0x2002 {
        return internal_v4(v4(s[1], s[2]));
    }
    let in_range = |prefix: u128, bits: u32| u128::from(ip) >> (128 - bits) == prefix >> (128 - bits);
    ip.is_multicast()
        || ip.is_unique_local()
        || ip.is_unicast_link_local()
        || in_range(0xfec0 << 112, 10) // site-local (deprecated, still routed by some)
        || in_range(0x0064_ff9b_0001 << 80, 48) // local-use NAT64, whose v4 is not fixed
        || in_range(0x2001 << 112, 32) // Teredo, whose v4 is obscured
        || in_range(0x2001_0db8 << 96, 32) // documentation
        || in_range(0x0100 << 112, 64) // discard
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
            "::127.0.0.1",
            "::ffff:0:10.0.0.1",
            "64:ff9b:1::808:808",
            "2002:7f00:1::",
            "2001:0:4136:e378::1",
            "fec0::1",
            "2001:db8::1",
            "100::1",
            "192.0.2.1",
            "198.51.100.7",
            "203.0.113.9",
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
            "2002:808:808::1",
            "2001:4860::8888",
        ];
        for a in allowed {
            assert!(!internal(a.parse().unwrap()), "{a} should be allowed");
        }
    }
}
