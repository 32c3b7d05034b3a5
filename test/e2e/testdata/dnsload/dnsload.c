/*
 * dnsload: resolves names through the C library's getaddrinfo (glibc or musl,
 * whichever it is linked with) at a fixed total rate from several threads, until
 * SIGTERM or -d seconds, one lookup per call (AF_INET: one A query), each a fresh
 * resolver socket, as applications do. Arguments after the flags are
 * name=expected-address pairs, used in turn.
 *
 *   dnsload -r RATE -t THREADS -d SECONDS [-i] name=ip ...
 *
 * -i also stops at the end of standard input (a test driving it through
 * `kubectl exec -i` stops it by closing the stream).
 *
 * A name with "%d" in it gets a new number each time (a name no cache holds).
 *
 * Every lookup that did not return the expected address is printed as
 *   FAIL <start ns> <end ns> <name> <what>
 * (CLOCK_MONOTONIC; what: wrong:<addr>, nxdomain, again, or eai:<code>), and at
 * the end
 *   SUMMARY sent=N ok=N wrong=N nxdomain=N failed=N
 * nxdomain means the name does not exist where the query went: for a mesh name,
 * the original nameserver answered instead of meshdns.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netdb.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static struct target {
	const char *name;
	struct in_addr want;
} *targets;
static int ntargets;
static double interval_ns; /* per thread */
static atomic_int stop;
static atomic_long sent, ok, wrong, nxdomain, failed;
static pthread_mutex_t out = PTHREAD_MUTEX_INITIALIZER;

static long long now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void report(long long start, long long end, const char *name, const char *what)
{
	pthread_mutex_lock(&out);
	printf("FAIL %lld %lld %s %s\n", start, end, name, what);
	pthread_mutex_unlock(&out);
}

static void *worker(void *arg)
{
	long id = (long)arg;
	long long next = now_ns() + (long long)(interval_ns * id / 16);
	long i = id;

	while (!atomic_load(&stop)) {
		struct target *t = &targets[i % ntargets];
		struct addrinfo hints, *res = NULL;
		long long start, end, now = now_ns();
		char what[80], name[256];
		int rc;

		if (strstr(t->name, "%d"))
			snprintf(name, sizeof(name), t->name, (int)(id * 10000000L + i)); /* < 2^31 for 200 threads */
		else
			snprintf(name, sizeof(name), "%s", t->name);
		i++;

		if (next > now) {
			struct timespec d = {(next - now) / 1000000000LL, (next - now) % 1000000000LL};
			nanosleep(&d, NULL);
		}
		next += (long long)interval_ns;
		memset(&hints, 0, sizeof(hints));
		hints.ai_family = AF_INET;
		hints.ai_socktype = SOCK_DGRAM;
		start = now_ns();
		rc = getaddrinfo(name, NULL, &hints, &res);
		end = now_ns();
		atomic_fetch_add(&sent, 1);
		if (rc == 0) {
			struct sockaddr_in *sin = (struct sockaddr_in *)res->ai_addr;
			if (sin->sin_addr.s_addr == t->want.s_addr) {
				atomic_fetch_add(&ok, 1);
			} else {
				char addr[INET_ADDRSTRLEN];

				/* inet_ntop, not inet_ntoa: musl's inet_ntoa writes one static
				 * buffer that another thread may be clearing. */
				inet_ntop(AF_INET, &sin->sin_addr, addr, sizeof(addr));
				atomic_fetch_add(&wrong, 1);
				snprintf(what, sizeof(what), "wrong:%s", addr);
				report(start, end, name, what);
			}
			freeaddrinfo(res);
		} else if (rc == EAI_NONAME) {
			atomic_fetch_add(&nxdomain, 1);
			report(start, end, name, "nxdomain");
		} else {
			atomic_fetch_add(&failed, 1);
			if (rc == EAI_AGAIN)
				snprintf(what, sizeof(what), "again");
			else
				snprintf(what, sizeof(what), "eai:%d", rc);
			report(start, end, name, what);
		}
	}
	return NULL;
}

static void on_term(int sig)
{
	(void)sig;
	atomic_store(&stop, 1);
}

static void *stdin_watch(void *arg)
{
	char buf[256];
	(void)arg;
	while (read(0, buf, sizeof(buf)) > 0)
		;
	atomic_store(&stop, 1);
	return NULL;
}

int main(int argc, char **argv)
{
	double rate = 100, secs = 3600;
	int threads = 8, opt, watch_stdin = 0;
	pthread_t *tids, watcher;

	while ((opt = getopt(argc, argv, "r:t:d:i")) != -1) {
		switch (opt) {
		case 'i': watch_stdin = 1; break;
		case 'r': rate = atof(optarg); break;
		case 't': threads = atoi(optarg); break;
		case 'd': secs = atof(optarg); break;
		default:
			fprintf(stderr, "usage: dnsload -r RATE -t THREADS -d SECONDS [-i] name=ip ...\n");
			return 2;
		}
	}
	ntargets = argc - optind;
	if (ntargets <= 0 || threads <= 0 || rate <= 0) {
		fprintf(stderr, "dnsload: need name=ip arguments, threads and rate\n");
		return 2;
	}
	targets = calloc(ntargets, sizeof(*targets));
	for (int i = 0; i < ntargets; i++) {
		char *arg = strdup(argv[optind + i]), *eq = strchr(arg, '=');
		if (!eq || inet_pton(AF_INET, eq + 1, &targets[i].want) != 1) {
			fprintf(stderr, "dnsload: bad target %s\n", argv[optind + i]);
			return 2;
		}
		*eq = 0;
		targets[i].name = arg;
	}
	interval_ns = 1e9 * threads / rate;
	signal(SIGTERM, on_term);
	signal(SIGINT, on_term);
	setvbuf(stdout, NULL, _IOLBF, 0);
	printf("START %lld\n", now_ns());
	if (watch_stdin)
		pthread_create(&watcher, NULL, stdin_watch, NULL);
	tids = calloc(threads, sizeof(*tids));
	for (long i = 0; i < threads; i++)
		pthread_create(&tids[i], NULL, worker, (void *)i);
	for (double waited = 0; waited < secs && !atomic_load(&stop); waited += 0.05)
		usleep(50000);
	atomic_store(&stop, 1);
	for (int i = 0; i < threads; i++)
		pthread_join(tids[i], NULL);
	printf("SUMMARY sent=%ld ok=%ld wrong=%ld nxdomain=%ld failed=%ld\n", atomic_load(&sent), atomic_load(&ok),
	       atomic_load(&wrong), atomic_load(&nxdomain), atomic_load(&failed));
	return 0;
}
