// A musl-linked getaddrinfo client for the datapath tests: prints each address
// getaddrinfo(argv[1]) returns, one per line, or "error: ..." and exits 1.
#include <arpa/inet.h>
#include <netdb.h>
#include <stdio.h>
#include <string.h>

int main(int argc, char **argv)
{
	struct addrinfo hints, *res, *p;
	char buf[INET6_ADDRSTRLEN];
	int rc;

	if (argc != 2) {
		fprintf(stderr, "usage: %s name\n", argv[0]);
		return 2;
	}
	memset(&hints, 0, sizeof(hints));
	hints.ai_family = AF_UNSPEC;
	hints.ai_socktype = SOCK_STREAM;
	rc = getaddrinfo(argv[1], NULL, &hints, &res);
	if (rc != 0) {
		printf("error: %s\n", gai_strerror(rc));
		return 1;
	}
	for (p = res; p; p = p->ai_next) {
		const void *a = p->ai_family == AF_INET
			? (const void *)&((struct sockaddr_in *)p->ai_addr)->sin_addr
			: (const void *)&((struct sockaddr_in6 *)p->ai_addr)->sin6_addr;
		if (inet_ntop(p->ai_family, a, buf, sizeof(buf)))
			printf("%s\n", buf);
	}
	freeaddrinfo(res);
	return 0;
}
