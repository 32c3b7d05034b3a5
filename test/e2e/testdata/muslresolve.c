/* muslresolve: getaddrinfo() through musl's stub resolver (built with musl-gcc
 * -static). musl sends unconnected UDP to every nameserver at once, on an AF_INET6
 * socket with v4-mapped addresses when any nameserver is IPv6, and drops replies
 * whose source is not a configured nameserver. Prints one address a line, or
 * NXDOMAIN. */
#include <arpa/inet.h>
#include <netdb.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>

int main(int argc, char **argv) {
	for (int i = 1; i < argc; i++) {
		struct addrinfo hints, *res, *p;
		memset(&hints, 0, sizeof hints);
		hints.ai_family = AF_UNSPEC;
		hints.ai_socktype = SOCK_STREAM;
		int rc = getaddrinfo(argv[i], NULL, &hints, &res);
		if (rc == EAI_NONAME) {
			printf("NXDOMAIN\n");
			continue;
		}
		if (rc != 0) {
			fprintf(stderr, "muslresolve: %s: %s\n", argv[i], gai_strerror(rc));
			return 1;
		}
		for (p = res; p; p = p->ai_next) {
			char buf[INET6_ADDRSTRLEN];
			void *a = p->ai_family == AF_INET ? (void *)&((struct sockaddr_in *)p->ai_addr)->sin_addr
			                                  : (void *)&((struct sockaddr_in6 *)p->ai_addr)->sin6_addr;
			printf("%s\n", inet_ntop(p->ai_family, a, buf, sizeof buf));
		}
		freeaddrinfo(res);
	}
	return 0;
}
