/*
 * echo: the benchmark's machine floor. A UDP server that blocks in recvfrom(2)
 * on one address and sends every DNS query straight back as its own answer (QR
 * and RA set, RCODE NOERROR, no records): no lookup, no allocation, no runtime.
 * Whatever latency it shows at a fixed rate is what this machine's wake-ups,
 * scheduler and loopback cost any server; bench/cmd/benchrun runs it on the
 * server core beside our resolver's fixed-rate runs.
 *
 * Usage: echo ADDRESS PORT   (IPv4; runs until killed)
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>

int main(int argc, char **argv)
{
	if (argc != 3) {
		fprintf(stderr, "usage: %s ADDRESS PORT\n", argv[0]);
		return 2;
	}
	struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((unsigned short)atoi(argv[2]))};
	if (inet_pton(AF_INET, argv[1], &addr.sin_addr) != 1) {
		fprintf(stderr, "echo: bad IPv4 address %s\n", argv[1]);
		return 2;
	}
	int fd = socket(AF_INET, SOCK_DGRAM, 0);
	if (fd < 0) {
		perror("echo: socket");
		return 1;
	}
	if (bind(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
		perror("echo: bind");
		return 1;
	}
	unsigned char buf[4096];
	for (;;) {
		struct sockaddr_in from;
		socklen_t fromlen = sizeof from;
		ssize_t n = recvfrom(fd, buf, sizeof buf, 0, (struct sockaddr *)&from, &fromlen);
		if (n < 12)
			continue; /* an error or not a DNS header */
		buf[2] |= 0x80; /* QR */
		buf[3] = 0x80;  /* RA, RCODE NOERROR */
		sendto(fd, buf, (size_t)n, 0, (struct sockaddr *)&from, fromlen);
	}
}
