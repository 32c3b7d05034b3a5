/*
 * egressload: resolve -> connect cycles through the C library's getaddrinfo
 * (glibc or musl, whichever it is linked with), as an application that resolves
 * a name and connects to what it got.
 *
 *   egressload -n CYCLES -p PORT [-u] [-x PREFIX] name
 *
 * Each cycle resolves name (AF_INET, one A query on a fresh resolver socket),
 * then at once connects a TCP socket (or, with -u, a connected UDP socket that
 * sends one datagram and waits for its echo) to the first address on PORT, and
 * closes it. With -x PREFIX (a /16, e.g. 198.19) the cycle instead connects to
 * an address under PREFIX that no answer ever named: what DNS-gated egress must
 * deny.
 *
 * The connect latency is the time from getaddrinfo's return to connect's
 * (for UDP: to the echo). A TCP connect's SYN retransmits are read from
 * TCP_INFO. Every cycle that did not connect is printed as
 *   FAIL <cycle> <address> <what>      (what: eperm, errno:<n>, eai:<code>, timeout)
 * and at the end
 *   SUMMARY cycles=N ok=N eperm=N failed=N retrans=N p50_us=N p99_us=N max_us=N
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static long long now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int cmp_ll(const void *a, const void *b)
{
	long long x = *(const long long *)a, y = *(const long long *)b;
	return (x > y) - (x < y);
}

/* connect_once connects to addr:port; it returns 0 or an errno, and adds the
 * connection's SYN retransmits to *retrans. */
static int connect_once(struct in_addr addr, int port, int udp, long *retrans)
{
	struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port), .sin_addr = addr};
	int fd = socket(AF_INET, udp ? SOCK_DGRAM : SOCK_STREAM, 0);
	int err = 0;

	if (fd < 0)
		return errno;
	if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
		err = errno;
		goto out;
	}
	if (udp) {
		char buf[16] = "ping";
		struct pollfd p = {.fd = fd, .events = POLLIN};
		if (send(fd, buf, 4, 0) < 0) {
			err = errno;
			goto out;
		}
		if (poll(&p, 1, 2000) != 1) {
			err = ETIMEDOUT;
			goto out;
		}
		if (recv(fd, buf, sizeof(buf), 0) < 0)
			err = errno;
	} else {
		struct tcp_info ti;
		socklen_t len = sizeof(ti);
		if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &len) == 0)
			*retrans += ti.tcpi_total_retrans;
	}
out:
	close(fd);
	return err;
}

int main(int argc, char **argv)
{
	long cycles = 1000, ok = 0, eperm = 0, failed = 0, retrans = 0;
	int port = 0, udp = 0, opt;
	const char *never = NULL;

	while ((opt = getopt(argc, argv, "n:p:ux:")) != -1) {
		switch (opt) {
		case 'n': cycles = atol(optarg); break;
		case 'p': port = atoi(optarg); break;
		case 'u': udp = 1; break;
		case 'x': never = optarg; break;
		default: goto usage;
		}
	}
	if (optind != argc - 1 || port <= 0 || cycles <= 0)
		goto usage;
	const char *name = argv[optind];
	long long *lat = calloc(cycles, sizeof(*lat));
	long nlat = 0;
	if (!lat)
		return 1;

	for (long i = 0; i < cycles; i++) {
		struct in_addr addr;
		char abuf[INET_ADDRSTRLEN];
		long long t0;

		if (never) {
			char s[64];
			snprintf(s, sizeof(s), "%s.%ld.%ld", never, (i / 250) % 256, 1 + i % 250);
			if (inet_pton(AF_INET, s, &addr) != 1) {
				fprintf(stderr, "egressload: bad -x prefix %s\n", never);
				return 2;
			}
			t0 = now_ns();
		} else {
			struct addrinfo hints, *res = NULL;
			memset(&hints, 0, sizeof(hints));
			hints.ai_family = AF_INET;
			hints.ai_socktype = udp ? SOCK_DGRAM : SOCK_STREAM;
			int rc = getaddrinfo(name, NULL, &hints, &res);
			if (rc != 0) {
				printf("FAIL %ld - eai:%d\n", i, rc);
				failed++;
				continue;
			}
			addr = ((struct sockaddr_in *)res->ai_addr)->sin_addr;
			freeaddrinfo(res);
			t0 = now_ns();
		}
		int err = connect_once(addr, port, udp, &retrans);
		long long d = now_ns() - t0;
		inet_ntop(AF_INET, &addr, abuf, sizeof(abuf));
		if (err == 0) {
			ok++;
			lat[nlat++] = d;
		} else if (err == EPERM) {
			eperm++;
			printf("FAIL %ld %s eperm\n", i, abuf);
		} else {
			failed++;
			if (err == ETIMEDOUT)
				printf("FAIL %ld %s timeout\n", i, abuf);
			else
				printf("FAIL %ld %s errno:%d\n", i, abuf, err);
		}
	}
	qsort(lat, nlat, sizeof(*lat), cmp_ll);
	long long p50 = nlat ? lat[nlat / 2] : 0, p99 = nlat ? lat[(nlat * 99) / 100 < nlat ? (nlat * 99) / 100 : nlat - 1] : 0;
	long long mx = nlat ? lat[nlat - 1] : 0;
	printf("SUMMARY cycles=%ld ok=%ld eperm=%ld failed=%ld retrans=%ld p50_us=%lld p99_us=%lld max_us=%lld\n",
	       cycles, ok, eperm, failed, retrans, p50 / 1000, p99 / 1000, mx / 1000);
	return 0;
usage:
	fprintf(stderr, "usage: egressload -n CYCLES -p PORT [-u] [-x PREFIX] name\n");
	return 2;
}
